"""Check model files before OpenVINO reads them.

OpenVINO's IR reader trusts its input: a Const whose offset+size overflows, a duplicate
`<layer id>` or an entity-expanding DTD is read differently by different parsers or crashes
the process (REFERENCE.md §8). kvc validates first, with `defusedxml` (no DTD, no entities)
and overflow-safe arithmetic, and reports the file, the layer and what it expected.
ONNX models are checked for external-data paths that leave their directory
(CVE-2022-25882, CVE-2024-27318).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree
from xml.etree.ElementTree import Element

import defusedxml.ElementTree as SafeET
from defusedxml import DefusedXmlException

from kvc.errors import InvalidModelError

# Bits per element of every element type an IR v10/v11 file may name (ov::element::Type).
ELEMENT_BITS: dict[str, int] = {
    "boolean": 8, "bf16": 16, "f16": 16, "f32": 32, "f64": 64,
    "i4": 4, "i8": 8, "i16": 16, "i32": 32, "i64": 64,
    "u1": 1, "u2": 2, "u3": 3, "u4": 4, "u6": 6, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "nf4": 4, "f8e4m3": 8, "f8e5m2": 8, "f8e8m0": 8, "f4e2m1": 4,
}
# Types whose Const size is not a function of the shape (variable-length payloads).
VARIABLE_SIZE_TYPES = {"string"}
# Types that may appear on ports and Parameters but never describe stored Const data.
NON_DATA_TYPES = {"dynamic", "undefined"}

_U64_MAX = 2**64 - 1
_DIM = re.compile(r"^(-1|\?|\d+|\d*\.\.\d*)$")
_INT = re.compile(r"^\d+$")


@dataclass(frozen=True)
class _Layer:
    """What the validator needs of one `<layer>`: where it is, its ports."""

    id: str
    name: str
    type: str
    inputs: frozenset[str]
    outputs: frozenset[str]

    def label(self) -> str:
        return f"layer {self.id} '{self.name}' ({self.type})"


def validate_ir(xml_path: Path, bin_path: Path | None = None,
                early: Callable[[list[tuple[int, int]]], None] | None = None) -> list[tuple[int, int]]:
    """Raise InvalidModelError unless `xml_path` (and its `.bin`) is a well-formed, safe IR.

    Returns where the numeric Consts' bytes are in the `.bin` (offset, size), for whoever
    wants to start reading them before OpenVINO has read the model. `early` gets a first
    guess of that list before the XML is parsed (from OpenVINO's own layout of a Const
    layer, read off the bytes; empty for any other spelling): unchecked, good enough to
    start copying the weights 0.1 s sooner."""
    xml_path = Path(xml_path)
    bin_path = Path(bin_path) if bin_path is not None else xml_path.with_suffix(".bin")
    file = str(xml_path)
    root = _parse_xml(xml_path, early)
    if root.tag != "net":
        raise InvalidModelError("not-ir", file, "root element is not <net>",
                                expected="<net>", found=f"<{root.tag}>")
    consts = _check_graph(root, file, path="", dims=not _dims_valid(root))
    _check_variables(root, file)
    if not consts:
        return []
    if not bin_path.is_file():
        raise InvalidModelError("bin-missing", file, f"weights file {bin_path.name} does not exist",
                                expected=f"{bin_path.name} beside the .xml", found="nothing")
    bin_size = bin_path.stat().st_size
    placed = []
    for layer, data in consts:
        offset, size = _check_const(layer, data, bin_size, file, bin_path.name)
        if size and data.get("element_type") in ELEMENT_BITS:  # strings are not read in place
            placed.append((offset, size))
    return placed


def _parse_xml(xml_path: Path, early: Callable[[list[tuple[int, int]]], None] | None = None) -> Element:
    file = str(xml_path)
    try:
        raw = xml_path.read_bytes()
    except FileNotFoundError:
        raise InvalidModelError("missing-file", file, "file does not exist") from None
    if early is not None and (guess := guess_consts(raw)):
        early(guess)
    if not raw.strip():
        raise InvalidModelError("empty-file", file, "file is empty",
                                expected="an IR <net> document", found=f"{len(raw)} bytes")
    try:
        if _no_dtd(raw):  # nothing to defuse: the C parser, 1.5x faster than defusedxml's
            return _parse_in_slices(raw)
        return SafeET.fromstring(raw, forbid_dtd=True, forbid_entities=True,
                                 forbid_external=True)
    except DefusedXmlException as exc:
        raise InvalidModelError("xml-forbidden", file,
                                f"XML uses a construct kvc refuses to parse ({type(exc).__name__})",
                                expected="no DOCTYPE, entities or external references",
                                found=str(exc)) from None
    except SafeET.ParseError as exc:
        raise InvalidModelError("not-xml", file, f"not well-formed XML: {exc}") from None


# A Const layer as OpenVINO's serializer writes it (optimum-intel's exports among them).
_CONST_LAYER = re.compile(rb'type="Const" version="opset1">\s*<data element_type="([a-z0-9]+)" shape="[^"]*" '
                          rb'offset="(\d+)" size="(\d+)"')


def guess_consts(raw: bytes) -> list[tuple[int, int]]:
    """(offset, size) of the numeric Consts written as OpenVINO writes them, unvalidated."""
    return [(int(m.group(2)), int(m.group(3))) for m in _CONST_LAYER.finditer(raw)
            if m.group(1).decode() in ELEMENT_BITS and m.group(3) != b"0"]


def _parse_in_slices(raw: bytes, step: int = 1 << 16) -> Element:
    """`ElementTree.fromstring`, fed 64 KB at a time: the parser holds the GIL while it runs,
    and a large IR takes it 50 ms, during which the thread copying the weights (started from
    `early`) could not even begin."""
    parser = ElementTree.XMLParser()
    for start in range(0, len(raw), step):
        parser.feed(raw[start:start + step])
    return parser.close()


_DECLARED_ENCODING = re.compile(rb'^\s*<\?xml[^>]*encoding\s*=\s*["\']([A-Za-z0-9._-]+)["\']')


def _no_dtd(raw: bytes) -> bool:
    """True when `raw` is plainly UTF-8 (or ASCII) and has no DOCTYPE or ENTITY declaration
    anywhere: every XML attack kvc defends against (entity expansion, external entities and
    DTDs) needs one, and in an ASCII-compatible encoding it would appear as these bytes."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in raw[:64]:
        return False  # UTF-16/32: the markup is not these bytes
    declared = _DECLARED_ENCODING.match(raw.removeprefix(b"\xef\xbb\xbf"))
    if declared and declared.group(1).lower() not in (b"utf-8", b"utf8", b"us-ascii", b"ascii"):
        return False
    return b"<!DOCTYPE" not in raw and b"<!ENTITY" not in raw


def _dims_valid(root: Element) -> bool:
    """Every <dim> in the document is valid: one pass over them, each distinct text matched
    once (a 16-layer LLM has 15 000 <dim>s and a few dozen distinct ones)."""
    seen: set[str | None] = set()
    for dim in root.iter("dim"):
        if dim.text not in seen:
            if not _DIM.match((dim.text or "").strip()):
                return False
            seen.add(dim.text)
    return True


MAX_BODY_DEPTH = 16  # bodies within bodies (If, Loop, TensorIterator): models nest a few at most


def _check_graph(net: Element, file: str, path: str, dims: bool = True, depth: int = 0) -> list[tuple[_Layer, Element]]:
    """Check one (possibly nested) graph; return its Const layers with their <data>. `dims`:
    check every port's dimensions here (False when `_dims_valid` found them all valid).
    Bodies nest at most MAX_BODY_DEPTH deep (3000 nested bodies exhausted Python's recursion:
    exit 1, "internal error")."""
    if depth > MAX_BODY_DEPTH:
        raise InvalidModelError("nesting-too-deep", file, f"{path}bodies nest more than {MAX_BODY_DEPTH} deep",
                                expected=f"at most {MAX_BODY_DEPTH} nested bodies", found="more")
    layers_el = net.find("layers")
    if layers_el is None:
        raise InvalidModelError("not-ir", file, f"{path or '<net>'} has no <layers>",
                                expected="<layers>", found="nothing")
    layers: dict[str, _Layer] = {}
    consts: list[tuple[_Layer, Element]] = []
    for el in layers_el.findall("layer"):
        layer = _read_layer(el, file, path)
        if layer.id in layers:
            other = layers[layer.id]
            raise InvalidModelError(
                "duplicate-layer-id", file, f"{path}layer id {layer.id} is used twice",
                layer=layer.label(), expected="unique layer ids",
                found=f"'{other.name}' ({other.type}) and '{layer.name}' ({layer.type})")
        layers[layer.id] = layer
        if dims:  # layer by layer, to say which one is wrong
            _check_ports(el, layer, file)
        data = el.find("data")
        if data is not None:
            _check_data(layer, data, file)
        if layer.type == "Const" and data is not None:
            consts.append((layer, data))
        body = el.find("body")
        if body is not None:
            consts += _check_graph(body, file, path=f"{path}{layer.label()} body: ", dims=dims, depth=depth + 1)
        for nested in el.findall("then_body") + el.findall("else_body"):
            consts += _check_graph(nested, file, path=f"{path}{layer.label()} {nested.tag}: ", dims=dims,
                                   depth=depth + 1)
    _check_edges(net, layers, file, path)
    return consts


def _check_variables(root: Element, file: str) -> None:
    """Every Assign writes a variable some ReadValue reads (OpenVINO creates variables from
    ReadValues, and otherwise fails with a bare 'map::at'). A ReadValue without an Assign is
    valid: its variable keeps its initial value."""
    read, assigns = set(), []
    for el in root.iter("layer"):
        if el.get("type") in ("ReadValue", "Assign"):
            data = el.find("data")
            vid = data.get("variable_id") if data is not None else None
            if vid is None:
                raise InvalidModelError("bad-variable", file, "the state layer has no variable_id",
                                        layer=f"layer {el.get('id')} '{el.get('name', '')}' ({el.get('type')})",
                                        expected='<data variable_id="...">', found="none")
            if el.get("type") == "ReadValue":
                read.add(vid)
            else:
                assigns.append((el, vid))
    for el, vid in assigns:
        if vid not in read:
            known = ", ".join(sorted(read)[:4]) + (", ..." if len(read) > 4 else "") if read else "none"
            raise InvalidModelError("unknown-variable", file, f"Assign writes variable '{vid}', which no ReadValue reads",
                                    layer=f"layer {el.get('id')} '{el.get('name', '')}' (Assign)",
                                    expected=f"a ReadValue's variable_id ({known})", found=repr(vid))


def _read_layer(el: Element, file: str, path: str) -> _Layer:
    lid, ltype = el.get("id"), el.get("type")
    if lid is None or ltype is None or not _INT.match(lid):
        raise InvalidModelError("bad-layer", file, f"{path}<layer> lacks a numeric id or a type",
                                layer=f"layer '{el.get('name', '?')}'",
                                expected="id=<integer> type=<op>",
                                found=f"id={lid!r} type={ltype!r}")

    def port_ids(section: str) -> frozenset[str]:
        sec = el.find(section)
        return frozenset(p.get("id", "") for p in sec.findall("port")) if sec is not None else frozenset()

    return _Layer(lid, el.get("name", ""), ltype, port_ids("input"), port_ids("output"))


def _check_ports(el: Element, layer: _Layer, file: str) -> None:
    for section in ("input", "output"):
        sec = el.find(section)
        if sec is None:
            continue
        for port in sec.findall("port"):
            for dim in port.findall("dim"):
                text = (dim.text or "").strip()
                if not _DIM.match(text):
                    code = "negative-dimension" if text.startswith("-") else "bad-dimension"
                    raise InvalidModelError(
                        code, file, f"{section} port {port.get('id')} has an invalid dimension",
                        layer=layer.label(), expected="a size ≥ 0, -1 or ? (dynamic), or a..b",
                        found=repr(text))


def _check_data(layer: _Layer, data: Element, file: str) -> None:
    etype = data.get("element_type")
    if etype is not None and etype not in ELEMENT_BITS and etype not in VARIABLE_SIZE_TYPES \
            and etype not in NON_DATA_TYPES:
        raise InvalidModelError("unknown-element-type", file, "unknown element type",
                                layer=layer.label(), expected="one of " + ", ".join(sorted(ELEMENT_BITS)),
                                found=repr(etype))
    shape = data.get("shape")
    if shape is not None and layer.type in ("Const", "Parameter"):
        for dim in filter(None, (d.strip() for d in shape.split(","))):
            if not _DIM.match(dim):
                code = "negative-dimension" if dim.startswith("-") else "bad-dimension"
                raise InvalidModelError(code, file, "invalid dimension in shape attribute",
                                        layer=layer.label(), expected="sizes ≥ 0 (or ?/-1 for a Parameter)",
                                        found=repr(shape))


def _check_const(layer: _Layer, data: Element, bin_size: int, file: str, bin_name: str) -> tuple[int, int]:
    etype = data.get("element_type", "")
    raw_shape, raw_offset, raw_size = data.get("shape", ""), data.get("offset"), data.get("size")
    if raw_offset is None or raw_size is None or not _INT.match(raw_offset) or not _INT.match(raw_size):
        raise InvalidModelError("bad-const", file, "Const needs non-negative integer offset and size",
                                layer=layer.label(), expected="offset=<n> size=<n>",
                                found=f"offset={raw_offset!r} size={raw_size!r}")
    offset, size = int(raw_offset), int(raw_size)
    dims = [d.strip() for d in raw_shape.split(",") if d.strip()]
    if any(not _INT.match(d) for d in dims):
        code = "negative-dimension" if any(d.startswith("-") for d in dims) else "bad-dimension"
        raise InvalidModelError(code, file, "Const shape must be static and non-negative",
                                layer=layer.label(), expected="sizes ≥ 0", found=repr(raw_shape))
    if etype in ELEMENT_BITS:
        count = math.prod(int(d) for d in dims)
        expected = (count * ELEMENT_BITS[etype] + 7) // 8
        if size != expected:
            raise InvalidModelError(
                "const-size-mismatch", file, f"Const byte size disagrees with its shape [{raw_shape}] and {etype}",
                layer=layer.label(), expected=f"{expected} bytes", found=f"{size} bytes")
    elif etype in NON_DATA_TYPES:
        raise InvalidModelError("unknown-element-type", file, "Const has no concrete element type",
                                layer=layer.label(), expected="a storable element type", found=repr(etype))
    if offset > _U64_MAX - size:  # would wrap a 64-bit offset + size in C, as OpenVINO computes it
        raise InvalidModelError("offset-overflow", file, "Const offset + size overflows 64 bits",
                                layer=layer.label(), expected=f"offset + size ≤ {bin_size}",
                                found=f"offset {offset} + size {size}")
    # Written as OpenVINO's fixed check must be: never compute offset + size (REFERENCE.md §8).
    if size > bin_size or offset > bin_size - size:
        code = "bin-truncated" if offset <= bin_size else "const-out-of-range"
        reason = (f"{bin_name} is too short for this Const" if code == "bin-truncated"
                  else f"Const offset lies past the end of {bin_name}")
        raise InvalidModelError(code, file, reason, layer=layer.label(),
                                expected=f"offset + size ≤ {bin_size} bytes (size of {bin_name})",
                                found=f"offset {offset} + size {size}")
    return offset, size


def _check_edges(net: Element, layers: dict[str, _Layer], file: str, path: str) -> None:
    edges_el = net.find("edges")
    if edges_el is None:
        return
    for edge in edges_el.findall("edge"):
        fl, fp, tl, tp = (edge.get(k) for k in ("from-layer", "from-port", "to-layer", "to-port"))
        src, dst = layers.get(fl or ""), layers.get(tl or "")
        desc = f"{path}edge {fl}:{fp} -> {tl}:{tp}"
        if src is None or dst is None:
            missing = fl if src is None else tl
            raise InvalidModelError("dangling-edge", file, f"{desc} names a layer that does not exist",
                                    expected="an existing layer id", found=f"layer id {missing!r}")
        if fp not in src.outputs:
            raise InvalidModelError("dangling-edge", file, f"{desc} starts at a port the layer lacks",
                                    layer=src.label(), expected=f"output port in {sorted(src.outputs)}",
                                    found=repr(fp))
        if tp not in dst.inputs:
            raise InvalidModelError("dangling-edge", file, f"{desc} ends at a port the layer lacks",
                                    layer=dst.label(), expected=f"input port in {sorted(dst.inputs)}",
                                    found=repr(tp))


def check_inside(path: Path, root: Path, file: str, what: str) -> Path:
    """Resolve `path` (following symlinks) and refuse it unless it stays inside `root`."""
    resolved = Path(os.path.realpath(path))
    root_resolved = Path(os.path.realpath(root))
    if resolved != root_resolved and root_resolved not in resolved.parents:
        raise InvalidModelError("path-escape", file, f"{what} points outside the model directory",
                                expected=f"a path inside {root_resolved}", found=str(resolved))
    return resolved


def validate_onnx(onnx_path: Path) -> None:
    """Check an ONNX file parses and every external-data reference stays in its directory."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    file = str(onnx_path)
    raw_size = onnx_path.stat().st_size if onnx_path.exists() else -1
    if raw_size < 0:
        raise InvalidModelError("missing-file", file, "file does not exist")
    if raw_size == 0:
        raise InvalidModelError("empty-file", file, "file is empty",
                                expected="an ONNX ModelProto", found="0 bytes")
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise InvalidModelError("not-onnx", file, f"not a readable ONNX model: {exc}") from None
    base = onnx_path.parent
    for tensor in _onnx_tensors(model.graph):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        where = f"initializer '{tensor.name}'"
        if not info.location or os.path.isabs(info.location):
            raise InvalidModelError("path-escape", file, f"{where} has an absolute or empty external-data path",
                                    layer=where, expected="a path relative to the model directory",
                                    found=repr(info.location))
        target = check_inside(base / info.location, base, file, f"external data of {where}")
        if not target.is_file():
            raise InvalidModelError("bin-missing", file, f"external data of {where} does not exist",
                                    layer=where, expected=str(target), found="nothing")
        size = target.stat().st_size
        offset = int(info.offset or 0)
        length = int(info.length) if info.length is not None else size - offset
        if length < 0 or length > size or offset > size - length:
            raise InvalidModelError("const-out-of-range", file, f"external data of {where} lies past the end of its file",
                                    layer=where, expected=f"offset + length ≤ {size}",
                                    found=f"offset {offset} + length {length}")


def _onnx_tensors(graph):
    """Every TensorProto of a graph, its nodes' tensor attributes and subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _onnx_tensors(attr.g)
            for g in attr.graphs:
                yield from _onnx_tensors(g)
