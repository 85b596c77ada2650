"""Save several models that share weights as several `.xml` files and ONE weights file.

A static pipeline is one prefill model and several generate variants of the same network:
saving each with `ov.save_model` would write every weight once per model. kvc writes each
distinct constant once into `weights.bin` and points every model's Const layers at it:

1. constants are identified by the memory they view (OpenVINO clones and reshapes share a
   Constant's buffer, and weights stay memory-mapped from the input), so deduplication costs
   no hashing; bytes that live in a mapped file are copied file-to-file by the kernel
   (`copy_file_range`), never pulled through this process's memory;
2. each model is serialized with its Constants temporarily replaced by placeholder
   Parameters, so OpenVINO writes only the graph (no weights);
3. the placeholder layers are rewritten into Const layers with their offset and size.

Every file is written under a temporary name and renamed into place; the same models give
byte-identical files. Read a model back with `kvc.ir.load(xml, weights=dir/weights.bin)`
(or `core.read_model(xml, weights_path)`).
"""

from __future__ import annotations

import html
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvc.ir.writer import _fsync_file, fsync_dir

WEIGHTS_FILE = "weights.bin"
_ALIGN = 64
_PLACEHOLDER = "__kvc_const_"
_KERNEL_COPY_MIN = 1 << 16  # smaller constants are cheaper to write from memory


@dataclass(frozen=True)
class BundleEntry:
    xml: Path
    constants: int


def _raw(node: ov.Node) -> np.ndarray:
    data = np.asarray(node.get_data())
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _key(node: ov.Node) -> tuple[int, int]:
    data = np.asarray(node.get_data())
    return data.__array_interface__["data"][0], node.get_byte_size()


class _Mappings:
    """Which file (and where in it) an address of this process maps, from /proc/self/maps."""

    def __init__(self) -> None:
        self.regions: list[tuple[int, int, int, str]] = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].strip().startswith("/"):
                        start, end = (int(x, 16) for x in parts[0].split("-"))
                        self.regions.append((start, end, int(parts[2], 16), parts[5].strip()))
        except OSError:  # not Linux: every constant is written from memory
            pass

    def origin(self, address: int, size: int) -> tuple[str, int] | None:
        for start, end, offset, path in self.regions:
            if start <= address and address + size <= end:
                return path, offset + address - start
        return None


def _copy_range(src_path: str, offset: int, size: int, dst) -> bool:
    """Kernel-side copy of `size` bytes of `src_path` at `offset` to `dst`'s position."""
    if not hasattr(os, "copy_file_range"):
        return False
    try:
        with open(src_path, "rb") as src:
            if os.fstat(src.fileno()).st_size < offset + size:
                return False
            dst.flush()
            done = 0
            while done < size:
                n = os.copy_file_range(src.fileno(), dst.fileno(), size - done, offset + done)
                if n <= 0:
                    return done == size
                done += n
            dst.seek(0, os.SEEK_END)
            return True
    except OSError:
        return False


def save_bundle(models: dict[str, ov.Model], directory: str | Path, weights_name: str = WEIGHTS_FILE) -> dict[str, Path]:
    """Write `<name>.xml` for every model and one shared weights file; return the xml paths."""
    from kvc.ir.naming import canonicalize_friendly_names

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for model in models.values():
        canonicalize_friendly_names(model)
    offsets: dict[tuple[int, int], int] = {}
    mappings = _Mappings()
    weights_tmp = Path(tempfile.mkstemp(prefix=f".{weights_name}.", suffix=".tmp", dir=directory)[1])
    xml_tmps: dict[str, Path] = {}
    try:
        with open(weights_tmp, "wb") as weights:
            for name, model in models.items():
                consts = [n for n in model.get_ordered_ops() if n.get_type_name() == "Constant"]
                table = []
                for node in consts:
                    key = _key(node)
                    if key not in offsets:
                        pad = -weights.tell() % _ALIGN
                        weights.write(b"\0" * pad)
                        offsets[key] = weights.tell()
                        origin = mappings.origin(*key) if key[1] >= _KERNEL_COPY_MIN else None
                        if origin is None or not _copy_range(origin[0], origin[1], key[1], weights):
                            weights.write(memoryview(_raw(node)))
                    table.append((node, offsets[key]))
                xml_tmps[name] = _write_graph(model, table, directory, name)
            weights.flush()
            os.fsync(weights.fileno())
        os.replace(weights_tmp, directory / weights_name)
        out = {}
        for name, tmp in xml_tmps.items():
            _fsync_file(tmp)
            os.replace(tmp, directory / f"{name}.xml")
            out[name] = directory / f"{name}.xml"
        fsync_dir(directory)
        return out
    finally:
        weights_tmp.unlink(missing_ok=True)
        for tmp in xml_tmps.values():
            tmp.unlink(missing_ok=True)


def _write_graph(model: ov.Model, table: list[tuple[ov.Node, int]], directory: Path, name: str) -> Path:
    """Serialize the graph of `model` with Const layers pointing into the shared weights."""
    swaps = []
    for i, (const, offset) in enumerate(table):
        out = const.output(0)
        param = ops.parameter(out.get_partial_shape(), out.get_element_type())
        param.set_friendly_name(f"{_PLACEHOLDER}{i}")
        names = out.get_names()
        targets = list(out.get_target_inputs())
        for t in targets:
            t.replace_source_output(param.output(0))
        out.get_tensor().set_names(set())
        param.output(0).get_tensor().set_names(names)
        swaps.append((const, param, targets, names))
    model.add_parameters([p for _, p, _, _ in swaps])
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=directory))
    try:
        ov.save_model(model, str(tmp_dir / "graph.xml"), compress_to_fp16=False)
        text = (tmp_dir / "graph.xml").read_text()
    finally:
        for const, param, targets, names in swaps:
            for t in targets:
                t.replace_source_output(const.output(0))
            param.output(0).get_tensor().set_names(set())
            const.output(0).get_tensor().set_names(names)
            model.remove_parameter(param)
        for f in tmp_dir.iterdir():
            f.unlink()
        tmp_dir.rmdir()

    def to_const(m: re.Match) -> str:
        const, offset = table[int(m.group(2))]
        size = const.get_byte_size()
        friendly = html.escape(const.get_friendly_name(), quote=True)
        return (f'<layer id="{m.group(1)}" name="{friendly}" type="Const" version="opset1">{m.group(3)}'
                f'<data element_type="{m.group(5)}" shape="{m.group(4)}" offset="{offset}" size="{size}" />')

    pattern = re.compile(r'<layer id="(\d+)" name="' + _PLACEHOLDER + r'(\d+)" type="Parameter" version="opset1">'
                         r'(\s*)<data shape="([^"]*)" element_type="([^"]*)" />')
    text, count = pattern.subn(to_const, text)
    if count != len(table):
        raise RuntimeError(f"{name}: rewrote {count} of {len(table)} constant layers")
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.xml.", suffix=".tmp", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(tmp)
