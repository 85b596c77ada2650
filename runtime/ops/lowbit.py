"""Constant data as numpy arrays, including the types numpy lacks.

Most Constants are returned as zero-copy views of the (memory-mapped) weights. Three kinds
are copied, once per prepared model:

* packed sub-byte integers (u4/i4/u2/u1, as in int4-compressed LLM weights), unpacked to one
  element per byte, and bf16, widened to f32 (numpy has neither type);
* weights at a misaligned address: optimum-intel's `.bin` packs constants at arbitrary byte
  offsets, and numpy hands a misaligned array to its slow generic loops instead of BLAS
  (a 1 GB model's MatMuls ran 50x slower). The mapped pages are read once by the copy and
  can then be dropped by the OS. kvc's own `weights.bin` aligns every constant to 64 bytes,
  so compiled directories run without this copy.
"""

from __future__ import annotations

import math

import numpy as np
import openvino as ov

from kvc.runtime.ops.registry import static_dims


def _unpack_nibbles(raw: np.ndarray, count: int, signed: bool) -> np.ndarray:
    lo, hi = raw & 0x0F, raw >> 4
    out = np.stack([lo, hi], axis=-1).reshape(-1)[:count]
    if signed:
        return ((out.astype(np.int8) ^ 0x08) - 0x08).astype(np.int8)  # sign-extend 4 bits
    return out.astype(np.uint8)


def constant_array(node: ov.Node) -> np.ndarray:
    etype = node.get_output_element_type(0).get_type_name()
    shape = static_dims(node.get_output_shape(0))
    count = math.prod(shape)
    data = node.get_data()
    if etype in ("u4", "i4"):
        raw = np.asarray(data).view(np.uint8).reshape(-1)
        return _unpack_nibbles(raw, count, signed=etype == "i4").reshape(shape)
    if etype == "u2":
        raw = np.asarray(data).view(np.uint8).reshape(-1)
        parts = np.stack([(raw >> s) & 0x3 for s in (0, 2, 4, 6)], axis=-1).reshape(-1)[:count]
        return parts.astype(np.uint8).reshape(shape)
    if etype == "u1":  # most significant bit first
        raw = np.asarray(data).view(np.uint8).reshape(-1)
        return np.unpackbits(raw)[:count].reshape(shape)
    if etype == "bf16":
        bits = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if etype in ("nf4", "f8e4m3", "f8e5m2", "f4e2m1", "f8e8m0", "u3", "u6", "string"):
        raise NotImplementedError(f"Constant '{node.get_friendly_name()}' has element type {etype}, "
                                  "which kvc's interpreter does not implement")
    array = np.asarray(data).reshape(shape)
    if not array.flags["ALIGNED"] and array.size >= _ALIGN_COPY_MIN_ELEMENTS:
        return np.require(array, requirements=["A", "C"])
    return array


_ALIGN_COPY_MIN_ELEMENTS = 4096
