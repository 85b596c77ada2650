"""pin-rows: a first chunk of dynamic rows gets every output dimension but its rows static.

A first chunk of dynamic rows (`static-shape{rows=dynamic}`) takes inputs [1, ?]. OpenVINO's
shape inference keeps the other dimensions of its outputs static where the graph states them
as constants (optimum's IR), but not where a Reshape's `-1` stands beside the dynamic rows: an
ONNX export reshapes the new keys to [B, L, -1, D], and with L unknown the `-1` (the KV heads)
is too, so `present.N.key` came out [1, ?, ?, 16], and GPT-2's logits [?, 1, V]. The CPU plugin
resolves them when it compiles, but kvc must know them first: the If that holds the prefill
models pads each output to a static shape (`kvc.export.branches.bounded`), taking every
dynamic dimension for rows. Before this pass the ONNX Llama's present keys were padded to 32
heads for 2, and `kvc compile model.onnx` stopped with an internal error in its blob check.

kv-io keeps the KV heads where it removes the empty past (which told inference); what else is
lost is found here. The pass infers the output shapes of two copies of the model with one and
with two rows; a dimension that is the same in both is static and set by a Reshape before the
output (the tensor names move to it), the one that differs is the rows. A model whose outputs
are static but for one dimension after the first (the batch) is left as it is, uncopied:
optimum's IR costs nothing. An output with two dimensions that follow the rows cannot be
pinned, and the pass says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult
from kvc.passes.framework.registry import register_pass


def _dynamic(shape: ov.PartialShape) -> int:
    return shape.rank.get_length() if shape.rank.is_dynamic else sum(d.is_dynamic for d in shape)


def _settled(shape: ov.PartialShape) -> bool:
    """Static but for one dimension after the first (the batch, 1 in every kvc model)."""
    return shape.rank.is_static and (shape.is_static or (_dynamic(shape) == 1 and shape[0].is_static))


def _shapes_at(model: ov.Model, rows: int) -> list[list[int]] | None:
    """The output shapes of a copy of `model` whose inputs' dynamic dimensions are `rows`
    (None when shape inference leaves one dynamic)."""
    copy = model.clone()
    for param in copy.get_parameters():
        shape = param.get_partial_shape()
        if shape.is_dynamic:
            param.set_partial_shape(ov.PartialShape([rows if d.is_dynamic else d for d in shape]))
    copy.validate_nodes_and_infer_types()
    shapes = [port.get_partial_shape() for port in copy.outputs]
    return None if any(s.is_dynamic for s in shapes) else [list(s.to_shape()) for s in shapes]


@register_pass
@dataclass(frozen=True)
class PinRows(Pass):
    """A model of dynamic rows: every output dimension but the rows set static (by a Reshape) where inference lost it."""

    name: ClassVar[str] = "pin-rows"
    requires: ClassVar[tuple[str, ...]] = ("stateless", "static-but-rows")
    ensures: ClassVar[tuple[str, ...]] = ("static-but-rows", "outputs-but-rows")

    def run(self, model: ov.Model) -> PassResult:
        outputs = model.outputs
        if all(_settled(port.get_partial_shape()) for port in outputs):
            return PassResult(model, False)
        one, two = _shapes_at(model, 1), _shapes_at(model, 2)
        if one is None or two is None:
            raise self.fail("shape inference leaves an output dynamic even with every input static")
        for port, a, b in zip(outputs, one, two):
            shape = port.get_partial_shape()
            if _settled(shape):
                continue
            dims = [x if x == y else -1 for x, y in zip(a, b)]
            if dims.count(-1) > 1:
                raise self.fail(f"output {port.get_any_name()} {shape}: {dims.count(-1)} of its dimensions follow the "
                                f"rows ({a} with one row, {b} with two); a first chunk of dynamic rows may have one")
            result = port.get_node()
            value = result.input_value(0)
            pinned = ops.reshape(value, ops.constant(np.array(dims, np.int64)), False)
            pinned.set_friendly_name(f"{value.get_node().get_friendly_name()}/pin_rows")
            result.input(0).replace_source_output(pinned.output(0))
            names = value.get_names()
            value.get_tensor().set_names(set())
            pinned.output(0).get_tensor().set_names(names)
            result.validate_and_infer_types()
        return PassResult(model, True)


__all__ = ["PinRows"]
