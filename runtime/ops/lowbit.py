"""Constant data as numpy arrays, including the types numpy lacks.

Most Constants are returned as zero-copy views of the (memory-mapped) weights. Three kinds
are copied, once per prepared model:

* packed sub-byte integers (u4/i4/u3/u2/u1/u6, as in int4-compressed LLM weights), unpacked
  to one element per byte, and bf16, widened to f32 (numpy has neither type); u3 and u6 in
  OpenVINO 2026.4's grouped layout (`_unpack_u3`), which later OpenVINO sources describe as a
  plain bit stream, so tests/runtime/test_lowbit.py checks it against the installed OpenVINO;
* the floating-point types of NNCF's other weight formats (optimum-intel's `--weight-format
  nf4`, `mxfp4`, `cb4`, and NNCF's fp8, fp4 and nvfp4 modes), decoded to the f32 value of each
  code as OpenVINO defines the type (`_FLOAT_CODES`): nf4 (the QLoRA table,
  src/core/src/type/nf4.cpp), f4e2m1, f8e4m3 (no infinities, S.1111.111 is NaN), f8e5m2 (the
  upper byte of an f16), f8e8m0 (2^(e - 127), 0xFF NaN). Each is checked against OpenVINO's
  own constant folding over every code (tests/runtime/test_lowbit.py);
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


def _unpack_u3(raw: np.ndarray, count: int) -> np.ndarray:
    """u3 as OpenVINO 2026.4 packs it: each 8 values in 3 bytes, the first two holding their
    low 2 bits (4 a byte, the first value in the top bits), the third their high bits (the
    first value in bit 7)."""
    groups = -(-count // 8)
    raw = np.pad(raw[:groups * 3], (0, max(0, groups * 3 - raw.size))).reshape(groups, 3)
    low = np.stack([(raw[:, :2] >> s) & 0x3 for s in (6, 4, 2, 0)], axis=-1).reshape(groups, 8)
    high = np.stack([(raw[:, 2] >> s) & 0x1 for s in range(7, -1, -1)], axis=-1)
    return (low | (high << 2)).reshape(-1)[:count].astype(np.uint8)


def _unpack_u6(raw: np.ndarray, count: int) -> np.ndarray:
    """u6 as OpenVINO 2026.4 packs it: each 4 values in 3 bytes, the first two holding their
    low 4 bits (the first value in the top nibble), the third their high 2 bits (the first
    value in the top bits)."""
    groups = -(-count // 4)
    raw = np.pad(raw[:groups * 3], (0, max(0, groups * 3 - raw.size))).reshape(groups, 3)
    low = np.stack([raw[:, 0] >> 4, raw[:, 0] & 0xF, raw[:, 1] >> 4, raw[:, 1] & 0xF], axis=-1)
    high = np.stack([(raw[:, 2] >> s) & 0x3 for s in (6, 4, 2, 0)], axis=-1)
    return (low | (high << 4)).reshape(-1)[:count].astype(np.uint8)


def _f8e4m3(code: np.ndarray) -> np.ndarray:
    sign = np.where(code & 0x80, -1.0, 1.0)
    exponent, mantissa = (code >> 3) & 0x0F, code & 0x07
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    return np.where((exponent == 15) & (mantissa == 7), np.nan, sign * value)


def _f4e2m1(code: np.ndarray) -> np.ndarray:
    exponent, mantissa = (code >> 1) & 0x03, code & 0x01
    value = np.where(exponent == 0, mantissa * 0.5, (1 + mantissa / 2.0) * 2.0 ** (exponent - 1.0))
    return np.where(code & 0x08, -1.0, 1.0) * value


_CODES = np.arange(256, dtype=np.uint8)
# element type -> (bits per code, the f32 value of each code)
_FLOAT_CODES = {
    "nf4": (4, np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                         -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                         0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                         0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)),
    "f4e2m1": (4, _f4e2m1(_CODES[:16]).astype(np.float32)),
    "f8e4m3": (8, _f8e4m3(_CODES).astype(np.float32)),
    "f8e5m2": (8, (_CODES.astype(np.uint16) << 8).view(np.float16).astype(np.float32)),
    "f8e8m0": (8, np.where(_CODES == 0xFF, np.nan, 2.0 ** (_CODES.astype(np.float64) - 127)).astype(np.float32)),
}


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
    if etype in ("u3", "u6"):
        raw = np.asarray(data).view(np.uint8).reshape(-1)
        return (_unpack_u3 if etype == "u3" else _unpack_u6)(raw, count).reshape(shape)
    if etype in _FLOAT_CODES:
        bits, values = _FLOAT_CODES[etype]
        raw = np.asarray(data).view(np.uint8).reshape(-1)
        codes = _unpack_nibbles(raw, count, signed=False) if bits == 4 else raw[:count]
        return values[codes].reshape(shape)
    if etype == "u1":  # most significant bit first
        raw = np.asarray(data).view(np.uint8).reshape(-1)
        return np.unpackbits(raw)[:count].reshape(shape)
    if etype == "bf16":
        bits = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if etype == "string":
        raise NotImplementedError(f"Constant '{node.get_friendly_name()}' has element type {etype}, "
                                  "which kvc's interpreter does not implement")
    array = np.asarray(data).reshape(shape)
    if not array.flags["ALIGNED"] and array.size >= _ALIGN_COPY_MIN_ELEMENTS:
        return np.require(array, requirements=["A", "C"])
    return array


_ALIGN_COPY_MIN_ELEMENTS = 4096
