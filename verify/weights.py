"""Every weight of every compiled model, compared with the source's, byte for byte.

A probe proves only what it reads. Dense layers read every weight on every token, but a
mixture of experts reads an expert's weights only where its router picks it: an expert that no
probe token routes to (a rare expert, or one a router's bias keeps for other inputs) could be
wrong in every compiled model and every probe would still agree with the source. The token
embedding table is the same case, row by row (kvc.verify.embedding names the rows).

kvc's passes never change a weight: they rewire, reshape and add small constants (shapes,
masks, scales) around the source's constants, which they keep under their names. So the rule
checked here is that every weight of the source (a Constant of a float or low-bit integer type,
more than one element: quantized weights, their scales and zero points included) is in every
compiled model under its name, with the same element type, shape and bytes. A constant whose
name OpenVINO derived from a counter (``Constant_21041``, a router's bias) is matched by the
stable name kvc gives it (`hashed_name`: a hash of its type, shape and bytes).
Index constants (i32, i64, boolean) and scalars are not weights: static shapes rewrite them.
A pass that changes a weight must change this rule with it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import openvino as ov

from kvc.ir.naming import hashed_name, is_counter_name

_INDEX_TYPES = {"i32", "i64", "u32", "u64", "boolean"}
_SUFFIX = re.compile(r"~\d+$")  # canonicalize_friendly_names' suffix among equal constants
_CHUNK = 1 << 22  # bytes compared at a time (a bool temporary of this size, not of the weight's)


def _key(node: ov.Node) -> str:
    """The name a weight is matched by: its friendly name, or for a counter name (the source's,
    or a model's not yet canonicalized) or a canonical one, the canonical name without the `~k`
    that orders equal constants (which of them gets which suffix follows the graph's order)."""
    name = node.get_friendly_name()
    if is_counter_name(name):
        return hashed_name(node)
    return _SUFFIX.sub("", name) if "#" in name else name


def weights_of(model: ov.Model) -> dict[str, list[ov.Node]]:
    """The model's weights (see the module's rule), by the key they are matched by."""
    found: dict[str, list[ov.Node]] = {}
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Constant" or node.get_output_element_type(0).get_type_name() in _INDEX_TYPES:
            continue
        shape = node.get_output_partial_shape(0)
        if shape.is_static and int(np.prod(shape.to_shape(), dtype=np.int64)) > 1:
            found.setdefault(_key(node), []).append(node)
    return found


def _data(node: ov.Node) -> np.ndarray:
    return np.asarray(node.get_data())


class Files:
    """Weights files mapped in memory (`kvc.ir.reader.map_weights`): an array that lies in one
    is read from its file (`os.pread`, through the page cache) rather than through the
    mapping. Every page a mapping touches counts in the process's RSS, once per mapping: the
    250M Llama's source and compiled weights compared through theirs held 2 GB at once."""

    def __init__(self, mapped: list[tuple[ov.Tensor, Path]]):
        self._files = [(int(t.data.ctypes.data), int(t.data.nbytes), Path(path)) for t, path in mapped if t is not None]
        self._buffers = [np.empty(_CHUNK, np.uint8) for _ in range(2)] if self._files else []

    def chunks(self, a: np.ndarray, slot: int) -> Iterator[np.ndarray]:
        """`a`'s bytes, _CHUNK at a time (a file's in buffer `slot`, 0 or 1, valid until the next)."""
        start, size = int(a.ctypes.data), int(a.nbytes)
        for base, length, path in self._files:
            if base <= start and start + size <= base + length:
                buffer = self._buffers[slot]
                with open(path, "rb") as f:
                    for i in range(0, size, _CHUNK):
                        want = min(_CHUNK, size - i)
                        if os.preadv(f.fileno(), [buffer[:want]], start - base + i) != want:
                            raise OSError(f"{path}: {want} bytes at {start - base + i} could not be read")
                        yield buffer[:want]
                return
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        for i in range(0, size, _CHUNK):
            yield flat[i:i + _CHUNK]


def _same(x: np.ndarray, y: np.ndarray, files: Files) -> bool:
    """Whether two arrays hold the same bytes (the same memory does; a NaN equals itself)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.ctypes.data == y.ctypes.data or x.nbytes == 0:
        return True
    return all(_equal(a, b) for a, b in zip(files.chunks(x, 0), files.chunks(y, 1)))


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Two byte chunks of one length equal (compared 8 bytes at a time: twice as fast)."""
    whole = a.size // 8 * 8
    return (np.array_equal(a[:whole].view(np.uint64), b[:whole].view(np.uint64))
            and np.array_equal(a[whole:], b[whole:]))


def _difference(name: str, x: np.ndarray, y: np.ndarray, element_type: str) -> str:
    """What differs between the source's weight `x` and the compiled one's `y`."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return f"its weight {name!r} is {element_type} {list(y.shape)}, the source's {list(x.shape)}"
    if x.dtype.kind != "f":
        return f"its weight {name!r} ({element_type} {list(x.shape)}) differs from the source's"
    differs = x != y
    first = tuple(int(i) for i in np.argwhere(differs)[0])
    delta = float(np.max(np.abs(x[differs].astype(np.float64) - y[differs])))
    return (f"its weight {name!r} ({element_type} {list(x.shape)}) differs from the source's in "
            f"{int(differs.sum())} of {x.size} values, first at {list(first)} (max abs {delta:.3g})")


def model_differs(reference: dict[str, list[ov.Node]], model: ov.Model, equal: set,
                  files: Files = Files([])) -> str | None:
    """What differs between `model`'s weights and the source's `reference` (`weights_of`), or
    None. `equal`: the (source, compiled) buffers already found equal, by address and size (the
    static models share their weights: each is compared once); `files`: where to read them."""
    compiled = weights_of(model)
    for key, nodes in reference.items():
        candidates = compiled.get(key)
        if not candidates:
            node = nodes[0]
            return (f"it has no weight named {node.get_friendly_name()!r} (the source's "
                    f"{node.get_output_element_type(0).get_type_name()} {node.get_output_partial_shape(0)})")
        for node in nodes:
            x = _data(node)
            for other in candidates:
                y = _data(other)
                memo = (x.ctypes.data, y.ctypes.data, x.nbytes, y.nbytes)
                if memo in equal or _same(x, y, files):
                    equal.add(memo)
                    break
            else:
                return _difference(candidates[0].get_friendly_name(), x, _data(candidates[0]),
                                   node.get_output_element_type(0).get_type_name())
    return None


def check_weights(source: ov.Model, compiled: dict[str, ov.Model], files: Files = Files([]),
                  equal: set | None = None) -> dict:
    """Each compiled model's weights against the source's: {"ok", "compared", "reason"} (and
    "model" when one differs). `compared`: how many of the source's weights; `files`: the
    weights files the models are mapped over, read from the file; `equal`: filled with the
    (source, compiled) buffers found equal (`model_differs`)."""
    if not compiled:
        raise ValueError("no compiled model to compare")
    reference = weights_of(source)
    count = sum(map(len, reference.values()))
    equal = set() if equal is None else equal
    for name, model in sorted(compiled.items()):
        why = model_differs(reference, model, equal, files)
        if why is not None:
            return {"ok": False, "compared": count, "model": name, "reason": f"model {name!r}: {why}"}
    return {"ok": True, "compared": count,
            "reason": f"all {count} of the source's weights identical in {len(compiled)} models"}


def check_directory(source_path: str | Path, directory: Path, manifest: dict) -> dict:
    """The checks of what a probe cannot read, on a compiled directory's models (read from its
    IR over its weights file, unvalidated: written by kvc, or checked against the manifest's
    sha256) against the source model at `source_path`: {"embedding": `check_embeddings`,
    "weights": `check_weights`}. The source is loaded once for both; both weights files are
    mapped once and their weights read from the files (`Files`), the weights first: the
    embedding check then compares only a table they found different (to name its rows), not
    again through the mappings one they found equal."""
    from kvc.ir.reader import load, map_weights, resolve
    from kvc.verify.embedding import check_embeddings

    weights = directory / manifest["weights"]
    mapped = map_weights(weights)
    models = {name: load(directory / entry["xml"], weights=weights, mapped=mapped, validate=False)
              for name, entry in manifest["models"].items()}
    files = resolve(source_path)
    source_bin = files.weights if files.kind == "ir" and files.weights is not None and files.weights.exists() else None
    source_mapped = map_weights(source_bin) if source_bin is not None else None
    source = load(source_path, validate=False, mapped=source_mapped)
    equal: set = set()
    weights_result = check_weights(source, models, Files([(mapped, weights), (source_mapped, source_bin)]), equal)
    result = {"embedding": check_embeddings(source, models, equal), "weights": weights_result}
    del models, source  # before the mappings under their constants
    return result
