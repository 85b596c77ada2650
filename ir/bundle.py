"""Save several models that share weights as several `.xml` files and ONE weights file.

A static pipeline is one prefill model and several generate variants of the same network:
saving each with `ov.save_model` would write every weight once per model. kvc writes each
distinct constant once into `weights.bin` and points every model's Const layers at it:

1. constants are identified by the file bytes they map (weights stay memory-mapped from the
   input), else by the memory they view (OpenVINO clones and reshapes share a Constant's
   buffer), so deduplication costs no hashing; constants that lie back to back in a mapped
   file are laid out back to back again, each still at a multiple of 64 bytes, and read
   from that file as one run into a staging buffer that goes to disk (the model's mapped
   pages are not touched). The copy runs on a thread (`WeightsWriter`, `weights_stream.py`),
   started as soon as the input's XML is read, before OpenVINO even reads the model;
2. each model is serialized with its large Constants temporarily replaced by placeholder
   Parameters, so OpenVINO writes only the graph (no weights), into memory (/dev/shm);
3. the placeholder layers are rewritten into Const layers with their offset and size.

Every file is written under a temporary name and renamed into place; the same models give
byte-identical files. Read a model back with `kvc.ir.load(xml, weights=dir/weights.bin)`
(or `core.read_model(xml, weights_path)`).
"""

from __future__ import annotations

import bisect
import html
import logging
import os
import queue
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openvino as ov

from kvc.ir.reader import bodies
from kvc.ir.text_embeddings import detach, reattach
from kvc.ir.weights_stream import Origin as _Origin
from kvc.ir.weights_stream import Segment as _Segment
from kvc.ir.weights_stream import Stream as _Stream
from kvc.ir.weights_stream import pwrite_all
from kvc.ir.writer import fsync_dir, temp_file

log = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.bin"
_ALIGN = 64
_PLACEHOLDER = "__kvc_const_"
_PLACEHOLDER_MIN = 1024  # smaller constants are serialized as they are (shape constants among them)
_FILE_RUN_MIN = 1 << 16  # smaller runs are copied from memory rather than read from their file


def _as_bytes(data: np.ndarray) -> np.ndarray:
    """A Constant's data (from `get_data`) as flat bytes, a view when it is contiguous."""
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _aligned(offset: int) -> int:
    return offset + (-offset % _ALIGN)


class _Mappings:
    """Which file (and where in it) an address of this process maps, from /proc/self/maps
    (each line parsed once: most are the same from one call to the next)."""

    _last: tuple[str, list[int], list[tuple[int, int, _Origin]]] = ("", [], [])
    _lines: dict[str, tuple[int, int, _Origin] | None] = {}

    def __init__(self) -> None:
        try:
            with open("/proc/self/maps") as f:
                text = f.read()
        except OSError:  # not Linux: every constant is written from memory
            text = ""
        if text != _Mappings._last[0]:
            _Mappings._last = (text, *self._parse(text))
        _, self.starts, self.regions = _Mappings._last

    @staticmethod
    def _parse(text: str) -> tuple[list[int], list[tuple[int, int, _Origin]]]:
        known, lines = _Mappings._lines, {}
        for line in text.splitlines():
            lines[line] = known[line] if line in known else _Mappings._region(line)
        _Mappings._lines = lines
        regions = sorted((r for r in lines.values() if r is not None), key=lambda r: r[0])
        return [r[0] for r in regions], regions

    @staticmethod
    def _region(line: str) -> tuple[int, int, _Origin] | None:
        parts = line.split(maxsplit=5)
        path = parts[5].strip() if len(parts) == 6 else ""
        if not path.startswith("/") or path.endswith(" (deleted)"):
            return None
        start, end = (int(x, 16) for x in parts[0].split("-"))
        major, minor = (int(x, 16) for x in parts[3].split(":"))
        return start, end, _Origin(path, os.makedev(major, minor), int(parts[4]), int(parts[2], 16))

    def origin(self, address: int, size: int) -> _Origin | None:
        i = bisect.bisect_right(self.starts, address) - 1  # mappings do not overlap
        if i < 0:
            return None
        start, end, region = self.regions[i]
        if address + size > end:
            return None
        return region._replace(offset=region.offset + address - start)


_Key = tuple  # ("file", device, inode, offset, size) or ("memory", address, size)
_Distinct = dict[_Key, tuple[np.ndarray, "_Origin | None"]]


_BODY_OPS = ("If", "Loop", "TensorIterator")


def _constants(model: ov.Model, distinct: _Distinct, mappings: _Mappings, ops: list[ov.Node] | None = None,
               seen: dict[tuple[int, int], _Key] | None = None) -> list[tuple[ov.Node, _Key, bool]]:
    """`model`'s Constants, those of If/Loop bodies included, with their identities and whether
    they are at the top level; new ones are added to `distinct`.

    A constant is identified by the file bytes it maps (so the same weights mapped twice are
    stored once), else by the memory it views. `seen` remembers the identity of each buffer
    (address, size) across calls: the models of a bundle share most of their buffers, and
    `distinct` keeps every one of them alive, so an address cannot be reused meanwhile."""
    out = []
    seen = {} if seen is None else seen

    def visit(graph: ov.Model, top: bool) -> None:
        for node in ops if top and ops is not None else graph.get_ordered_ops():
            kind = node.get_type_name()
            if kind != "Constant":
                if kind in _BODY_OPS:
                    for body in bodies(node):
                        visit(body, False)
                continue
            data, size = node.get_data(), node.get_byte_size()
            buffer = (data.ctypes.data, size)
            key = seen.get(buffer)
            if key is None:
                origin = mappings.origin(*buffer) if size else None
                key = ("file", origin.device, origin.inode, origin.offset, size) if origin else ("memory", *buffer)
                if key not in distinct:
                    distinct[key] = (_as_bytes(data), origin)
                seen[buffer] = key
            out.append((node, key, top))

    visit(model, True)
    return out


def _layout(distinct: _Distinct) -> tuple[dict[_Key, int], list[_Segment], int]:
    """Place every distinct constant in the weights file, each at a multiple of 64 bytes.

    Constants that were back to back in a mapped file (and 64 apart modulo their run's start)
    form runs, placed first in file order; the rest follow in first-use order. Returns each
    constant's offset, the segments and the file size."""
    runs: list[list[_Key]] = []  # keys of constants adjacent in one mapped file
    last: tuple[_Origin, int] | None = None  # (start of the current run, its end) in its file
    for key in sorted((k for k in distinct if k[0] == "file"), key=lambda k: (distinct[k][1], k)):
        at, size = distinct[key][1], key[-1]
        if (last is not None and last[0][:3] == at[:3] and last[1] == at.offset
                and (at.offset - last[0].offset) % _ALIGN == 0):
            runs[-1].append(key)
            last = (last[0], at.offset + size)
        else:
            runs.append([key])
            last = (at, at.offset + size)

    offsets: dict[_Key, int] = {}
    segments: list[_Segment] = []
    end = 0
    for run in runs:
        start = distinct[run[0]][1]
        size = distinct[run[-1]][1].offset + run[-1][-1] - start.offset
        if size < _FILE_RUN_MIN:
            continue
        seg = _Segment(_aligned(end), size, start, [])
        for key in run:
            within = distinct[key][1].offset - start.offset
            offsets[key] = seg.offset + within
            seg.pieces.append((within, distinct[key][0]))
        segments.append(seg)
        end = seg.offset + size
    small: _Segment | None = None  # consecutive small constants: one write
    for key, (data, _) in distinct.items():
        if key in offsets:
            continue
        offsets[key] = at = _aligned(end)
        end = at + key[-1]
        if key[-1] >= _FILE_RUN_MIN:
            segments.append(_Segment(at, key[-1], None, [(0, data)]))
            small = None
            continue
        if small is None:
            small = _Segment(at, 0, None, [])
            segments.append(small)
        small.pieces.append((at - small.offset, data))
        small.size = end - small.offset
    return offsets, segments, end


class WeightsWriter:
    """The weights file of a bundle, written and fsynced beside the passes.

    Writing ~0.5 GB and fsyncing it is most of the cost of saving a static pipeline.
    `start_file(weights, consts)` (with where the input's Consts are in its weights file) or
    `start(model)` (with the model the bundle's models are built from, as loaded) lays out
    the runs of those constants and starts copying them on a thread while the passes run.
    `finish` then checks that layout against the final models' (from `Bundle.commit`): if it
    holds, it appends the rest; if a pass dropped a constant from a run, or the file changed
    meanwhile, it starts over. The file's bytes are the same either way. Use as a context
    manager: leaving it without `commit` removes the temporary file."""

    def __init__(self, directory: str | Path, name: str = WEIGHTS_FILE) -> None:
        self.directory, self.name = Path(directory), name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fd, self.tmp = temp_file(self.directory, f".{name}.")
        try:
            self.stream = _Stream(self.fd)
        except BaseException:
            os.close(self.fd)
            self.tmp.unlink(missing_ok=True)
            raise
        self.primed: list[_Segment] = []
        self.restarts = 0  # layouts that `finish` found different from the primed one
        self._started = False
        # (device, inode, constants) when primed by `start_file`: no bytes in memory to fall back on
        self._file_source: tuple | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cancelled = False

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:
            self._cancelled = True  # skip what is queued: the file is being thrown away
        try:
            self._stop()
        except BaseException:
            if exc_type is None:  # else the error already on its way matters more
                raise
        finally:
            self.stream.release()
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self.tmp.unlink(missing_ok=True)

    def start(self, model: ov.Model) -> None:
        """Begin copying the runs of `model`'s memory-mapped constants (unless `start_file`
        already began)."""
        if self._started:
            return
        distinct: _Distinct = {}
        _constants(model, distinct, _Mappings())
        self._prime([seg for seg in _layout(distinct)[1] if seg.source is not None])

    def start_file(self, path: Path, consts: list[tuple[int, int]]) -> None:
        """Begin copying the runs of the constants at (offset, size) in the weights file
        `path`, before OpenVINO has even read the model that maps them: as `start` would for
        that model, with nothing in memory to fall back on if the file changes meanwhile
        (`finish` then starts over). Called again with other constants (what validation
        found, after a first guess), it starts over with those."""
        try:
            stat = os.stat(path)
        except OSError:
            return
        source = (stat.st_dev, stat.st_ino, sorted(set(consts)))
        if self._started:
            if self._file_source is None or source == self._file_source:
                return  # started from the model itself, or from these very constants
            self._start_over()
        where = os.path.realpath(path)
        distinct: _Distinct = {("file", stat.st_dev, stat.st_ino, offset, size):
                               (None, _Origin(where, stat.st_dev, stat.st_ino, offset)) for offset, size in source[2]}
        self._prime([seg for seg in _layout(distinct)[1] if seg.source is not None], source)

    def _prime(self, primed: list[_Segment], file_source: tuple | None = None) -> None:
        self.primed, self._started, self._file_source = primed, True, file_source
        if primed:
            self._submit(primed)

    def _start_over(self) -> None:
        """Forget what was copied: the file is empty again."""
        self._stop()
        self.stream.reset()
        os.ftruncate(self.fd, 0)
        self.primed, self._file_source = [], None

    def finish(self, segments: list[_Segment], size: int) -> None:
        """Queue the final layout (all of it) and the fsync; returns at once."""
        placed = [seg.place() for seg in segments[:len(self.primed)]]
        whole = True  # did the copy get every byte it was asked for?
        if self._file_source is not None:
            self._stop()  # primed from the file alone: did the file give all of it?
            whole = not self.stream.short
        if placed != [seg.place() for seg in self.primed] or not whole:
            log.debug("weights: the final layout differs from the one copied during the passes; rewriting")
            self._start_over()
            self.restarts += 1
        self._submit([*segments[len(self.primed):], size])

    def commit(self) -> Path:
        """Wait for the thread; rename the finished file into place."""
        self._stop()
        self.stream.release()
        os.close(self.fd)
        self.fd = -1
        target = self.directory / self.name
        os.replace(self.tmp, target)
        return target

    def _submit(self, items: list) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvc-weights", daemon=True)
            self._thread.start()
        for item in items:
            self._queue.put(item)

    def _stop(self) -> None:
        """Join the thread (after what is queued); re-raise what it failed with."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        try:
            self.stream.settle()
        except BaseException as exc:
            self._error = self._error or exc
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None or self._cancelled:
                continue
            try:
                if isinstance(item, _Segment):
                    self.stream.write(item)
                else:  # the file's size: the end
                    self.stream.close(item)
            except BaseException as exc:  # re-raised on the caller's thread by _stop
                self._error = exc


class Bundle:
    """Several models written as `<name>.xml` files and one shared weights file.

    Models are added as they are built: each is serialized at once with its Constants as
    numbered placeholders, and restored. `commit` lays out the weights file, points the
    placeholders at it and renames everything into place. `start_weights_file` (from
    `kvc.ir.load(..., consts_found=)`) or `start_weights(model)` begins copying the weights of
    the model the others are built from (see WeightsWriter). Use as a context manager:
    leaving it without `commit` leaves nothing behind."""

    def __init__(self, directory: str | Path, weights_name: str = WEIGHTS_FILE) -> None:
        self.directory = Path(directory)
        self.weights = WeightsWriter(self.directory, weights_name)
        self._distinct: _Distinct = {}
        self._seen: dict[tuple[int, int], _Key] = {}  # buffer (address, size) -> its key in _distinct
        self._models: dict[str, tuple[list[tuple[ov.Node, _Key, bool]], str]] = {}
        try:
            self._scratch = _scratch()
        except BaseException:
            self.weights.__exit__(None, None, None)
            raise

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._scratch.cleanup()
        finally:
            self.weights.__exit__(*exc)

    def start_weights(self, model: ov.Model) -> None:
        self.weights.start(model)

    def start_weights_file(self, path: Path, consts: list[tuple[int, int]]) -> None:
        """`kvc.ir.load(..., consts_found=bundle.start_weights_file)` starts copying the
        model's weights before OpenVINO reads it (see WeightsWriter.start_file)."""
        self.weights.start_file(path, consts)

    def add(self, name: str, model: ov.Model) -> None:
        """Serialize the graph of `model` for `<name>.xml` (it must not change until `commit`).

        On this thread: OpenVINO's serializer holds the GIL, so a worker thread would only
        take turns with the passes."""
        from kvc.ir.naming import canonicalize_friendly_names

        if name in self._models:
            raise ValueError(f"{name}: added twice")
        ops = model.get_ordered_ops()
        canonicalize_friendly_names(model, ops)
        consts = _constants(model, self._distinct, _Mappings(), ops, self._seen)
        xml = Path(self._scratch.name) / f"{name}.xml"
        self._models[name] = (consts, _graph_text(model, [(node, top) for node, _, top in consts], xml))

    def commit(self) -> dict[str, Path]:
        """Write the weights file and every `.xml`, then rename them into place (the weights
        first, so no renamed `.xml` points at a missing or old weights file); return the xmls."""
        offsets, segments, size = _layout(self._distinct)
        self.weights.finish(segments, size)
        xml_tmps: dict[str, Path] = {}
        fds: list[int] = []
        try:
            for name, (consts, text) in self._models.items():
                graph = _point_at_weights(text, [(node, offsets[key], key[-1]) for node, key, _ in consts], name)
                fd, xml_tmps[name] = temp_file(self.directory, f".{name}.xml.")
                fds.append(fd)
                pwrite_all(fd, graph.encode("utf-8"), 0)
            # Together: the filesystem commits its journal once for all of them, not once each.
            with ThreadPoolExecutor(max(1, len(fds)), thread_name_prefix="kvc-fsync") as pool:
                list(pool.map(os.fsync, fds))
            self.weights.commit()
            out = {}
            for name, tmp in xml_tmps.items():
                os.replace(tmp, self.directory / f"{name}.xml")
                out[name] = self.directory / f"{name}.xml"
            fsync_dir(self.directory)
            return out
        finally:
            for fd in fds:
                os.close(fd)
            for tmp in xml_tmps.values():
                tmp.unlink(missing_ok=True)


def save_bundle(models: dict[str, ov.Model], directory: str | Path, weights_name: str = WEIGHTS_FILE) -> dict[str, Path]:
    """Write `<name>.xml` for every model and one shared weights file; return the xml paths."""
    with Bundle(directory, weights_name) as bundle:
        for name, model in models.items():
            bundle.add(name, model)
        return bundle.commit()


def _scratch() -> tempfile.TemporaryDirectory:
    """Where OpenVINO writes each graph before kvc rewrites it: memory (/dev/shm) when there is
    one, so that this does not wait on the journal commits of the weights file's fsync."""
    shm = Path("/dev/shm")
    return tempfile.TemporaryDirectory(prefix="kvc-graph-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None)


# Runtime info OpenVINO's reader attaches to every weight and its serializer never writes; a
# constant with any other (KeepConstPrecision on compressed weights, say) stays a Constant,
# as a placeholder Parameter cannot carry it from Python.
_UNWRITTEN_RT_INFO = ("WeightlessCacheAttribute",)


_WEIGHTLESS_KEY = "WeightlessCacheAttribute_0"  # its key today: a test of one key is 20x cheaper than listing


def _replaceable(const: ov.Node) -> bool:
    if const.get_byte_size() < _PLACEHOLDER_MIN:
        return False
    rt = const.get_rt_info()
    count = len(rt)
    if count == 0 or (count == 1 and _WEIGHTLESS_KEY in rt):
        return True
    return all(str(key).startswith(_UNWRITTEN_RT_INFO) for key in rt.keys())


class _Placeholders:
    """Each Constant renamed `__kvc_const_<i>` for serialization; top-level ones of at least
    `_PLACEHOLDER_MIN` bytes also replaced by a Parameter, so that OpenVINO writes no weights
    (the others' bytes go to /dev/null).

    Small constants stay: shape inference, which OpenVINO's serializer runs again, needs the
    values of shape constants. Constants inside If/Loop bodies stay (a body's Parameters are
    its inputs). `restore` puts everything back, also after a failure half-way."""

    def __init__(self, model: ov.Model, consts: list[tuple[ov.Node, bool]], replace: bool) -> None:
        self.model, self.names, self.swaps, self.added = model, [], [], False
        try:
            for i, (const, top) in enumerate(consts):
                self.names.append((const, const.get_friendly_name()))
                const.set_friendly_name(f"{_PLACEHOLDER}{i}")
                if replace and top and _replaceable(const):
                    self._swap(const, i)
            model.add_parameters([param for _, param, _, _ in self.swaps])
            self.added = True
        except BaseException:
            self.restore()
            raise

    def _swap(self, const: ov.Node, i: int) -> None:
        out = const.output(0)
        param = ov.op.Parameter(out.get_element_type(), out.get_partial_shape())
        param.set_friendly_name(f"{_PLACEHOLDER}{i}")
        names, targets = out.get_names(), list(out.get_target_inputs())
        self.swaps.append((const, param, targets, names))  # before any change: restore undoes all
        for t in targets:
            t.replace_source_output(param.output(0))
        out.get_tensor().set_names(set())
        param.output(0).get_tensor().set_names(names)

    def restore(self) -> None:
        for const, param, targets, names in self.swaps:
            for t in targets:
                t.replace_source_output(const.output(0))
            param.output(0).get_tensor().set_names(set())
            const.output(0).get_tensor().set_names(names)
            if self.added:
                self.model.remove_parameter(param)
        for const, name in self.names:
            const.set_friendly_name(name)
        self.swaps, self.names, self.added = [], [], False


def _graph_text(model: ov.Model, consts: list[tuple[ov.Node, bool]], xml: Path) -> str:
    """`model` serialized without its weights, Const layers named `__kvc_const_<i>` (to be
    pointed at the weights file by `_point_at_weights`); `model` is left as it was.

    OpenVINO's serializer infers shapes again, with the placeholders in place. A static model
    that stays static kept every shape; otherwise (a large constant decided a shape, or the
    model has dynamic shapes to lose precision in) it is inferred again with its constants and
    written with all of them, so the `.xml` and the model keep their true shapes."""
    static = not model.is_dynamic()
    embeddings = detach(model)  # a path on this machine: not written (a compiled directory finds its own)
    for replace in (static, False):
        placeholders = _Placeholders(model, consts, replace)
        try:
            ov.serialize(model, str(xml), os.devnull)
            text = xml.read_text(encoding="utf-8")
            lost = replace and model.is_dynamic()
        finally:
            placeholders.restore()
            reattach(model, embeddings)
        if not lost:
            return text
        model.validate_nodes_and_infer_types()
    raise AssertionError("unreachable")


_LAYER = re.compile(r'<layer id="(\d+)" name="' + _PLACEHOLDER + r'(\d+)" type="(Parameter|Const)" version="opset1">'
                    r'(\s*)<data (?:shape="([^"]*)" element_type="([^"]*)"|element_type="([^"]*)" shape="([^"]*)"'
                    r' offset="\d+" size="\d+") />')


_XML_SPECIAL = re.compile(r'[&<>"\']')


def _point_at_weights(text: str, table: list[tuple[ov.Node, int, int]], name: str) -> str:
    """Rewrite the `__kvc_const_<i>` layers of a serialized graph into Const layers at their
    offsets in the shared weights file, under their own names (`table`: node, offset, size)."""
    def to_const(m: re.Match) -> str:
        const, offset, size = table[int(m.group(2))]
        friendly = const.get_friendly_name()
        if _XML_SPECIAL.search(friendly):
            friendly = html.escape(friendly, quote=True)
        shape, etype = (m.group(5), m.group(6)) if m.group(3) == "Parameter" else (m.group(8), m.group(7))
        return (f'<layer id="{m.group(1)}" name="{friendly}" type="Const" version="opset1">{m.group(4)}'
                f'<data element_type="{etype}" shape="{shape}" offset="{offset}" size="{size}" />')

    text, count = _LAYER.subn(to_const, text)
    if count != len(table):
        raise RuntimeError(f"{name}: rewrote {count} of {len(table)} constant layers")
    return text
