"""Refuse a model whose weights hold a NaN.

A NaN weight makes every value computed from it NaN: such a model has no output to verify a
compile against, and a probe that never reads it (an embedding row no probe token selects)
would verify the compile OK while a user's prompt gets tokens chosen from NaN. `kvc compile`
scans the source's floating-point Constants before its passes run: one max over each (a NaN
propagates through it; the 250M Llama's 984 MB of f32 weights in 0.2-0.7 s, most of it
reading the pages the compile then copies anyway), then a count where one is found. Infinities
are allowed: -Inf is how graphs mask (a causal mask's fill value), and a weight that is Inf
where it should not be shows as NaN or Inf in the logits the verification judges.
"""

from __future__ import annotations

import numpy as np
import openvino as ov

from kvc.errors import InvalidModelError
from kvc.ir.reader import bodies

# bf16 has no numpy type: its NaNs are found in the bits (exponent all ones, mantissa not zero).
_BF16_EXPONENT, _BF16_MANTISSA = 0x7F80, 0x007F


def nan_count(node) -> int:
    """How many NaNs a Constant node holds (0 for a non-floating-point one)."""
    et = node.get_output_element_type(0)
    if et in (ov.Type.f32, ov.Type.f16, ov.Type.f64):
        data = node.get_data()
        return int(np.isnan(data).sum()) if data.size and np.isnan(np.max(data)) else 0
    if et == ov.Type.bf16:
        bits = np.frombuffer(node.get_tensor_view().data.tobytes(), np.uint16)  # small in practice
        return int(np.count_nonzero(((bits & _BF16_EXPONENT) == _BF16_EXPONENT) & ((bits & _BF16_MANTISSA) != 0)))
    return 0


def check_no_nan_weights(model: ov.Model, file: str) -> None:
    """Raise `InvalidModelError` (``nan-weights``, exit 3) naming the first Constant of `model`
    (its bodies' too) that holds a NaN."""
    for node in _constants(model):
        count = nan_count(node)
        if count:
            raise InvalidModelError(
                "nan-weights", file, "the model's weights hold NaN: everything computed from them is NaN, so "
                "there is nothing to verify a compile against", layer=node.get_friendly_name(),
                expected="finite values", found=f"{count} NaN of {int(np.prod(node.get_output_shape(0)))}")


def _constants(model: ov.Model):
    for node in model.get_ordered_ops():
        if node.get_type_name() == "Constant":
            yield node
        for body in bodies(node):
            yield from _constants(body)
