"""dense-experts: give a mixture of experts' grouped expert MatMuls a static shape.

Sparse MoE layers that group tokens by expert (GraniteMoE's ParallelExperts, as optimum
exports it) sort the ``N * k`` routed rows by expert and run each expert on its own block:

    sizes  = ReduceSum(scatter(zeros[N, E], topk_indices, 1), 0)        # rows per expert, data
    out    = Concat_0([MatMul(X[s_i : s_i + sizes[i]], W_i) for i in range(E)])

The block bounds are *values* computed from the router's TopK, not shapes, so no reshape,
shape inference or constant folding can make the Slices static: on static inputs OpenVINO
bounds each block by [0, N * k] and the NPU cannot run it.

The rewrite computes every expert on all rows and keeps, for each row, the expert whose block
holds it (blocks are contiguous, in expert order, and together cover all rows):

    out = MatMul(X, W_0);  out = Select(row >= s_i, MatMul(X, W_i), out)   for i = 1 .. E-1

Each row's numbers are its own expert's MatMul, unchanged (Select copies, nothing is added),
so the result is exactly the Concat's; the cost is E times the expert MatMuls' work. Applies to
a Concat on axis 0 whose inputs are MatMuls of Slices of one tensor along axis 0, the first
starting at constant 0 and each starting where the previous one stops; other models are
unchanged. Runs on dynamic models, before static-shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult, constant_ints, describe_node
from kvc.passes.framework.registry import register_pass
from kvc.passes.framework.rules import NoMatch, Rule

log = logging.getLogger(__name__)



def _same(a: ov.Output, b: ov.Output) -> bool:
    return a.get_node() is b.get_node() or (
        a.get_node().get_friendly_name() == b.get_node().get_friendly_name() and a.get_index() == b.get_index())


def _expert_block(value: ov.Output) -> tuple[ov.Output, ov.Output, ov.Output, ov.Node]:
    """(rows, start, stop, matmul) of `MatMul(Slice(rows, start, stop, [1], [0]), W)`."""
    matmul = value.get_node()
    if matmul.get_type_name() != "MatMul" or matmul.get_attributes().get("transpose_a"):
        raise NoMatch(f"input {describe_node(matmul)} is not a MatMul (without transpose_a)")
    slice_ = matmul.input_value(0).get_node()
    if slice_.get_type_name() != "Slice" or slice_.get_input_size() < 5:
        raise NoMatch(f"{describe_node(matmul)} does not multiply a Slice")
    rank = slice_.get_input_partial_shape(0).rank
    if rank.is_dynamic or rank.get_length() != 2:
        raise NoMatch(f"{describe_node(slice_)} does not slice a 2-D tensor")
    axes = constant_ints(slice_.input_value(4)) or [1]
    if constant_ints(slice_.input_value(3)) != [1] or [a % 2 for a in axes] != [0]:
        raise NoMatch(f"{describe_node(slice_)} is not a step-1 slice of rows (axis 0)")
    return slice_.input_value(0), slice_.input_value(1), slice_.input_value(2), matmul


def _expert_blocks(concat: ov.Node) -> tuple[ov.Node, list]:
    """A Concat on axis 0 of MatMuls of contiguous row blocks of one tensor, in order from 0."""
    if concat.get_input_size() < 2:
        raise NoMatch("it has one input")
    if concat.get_output_partial_shape(0).rank.is_dynamic or concat.get_attributes()["axis"] % 2 != 0:
        raise NoMatch("it does not concatenate 2-D rows (axis 0)")
    blocks = [_expert_block(v) for v in concat.input_values()]
    rows = blocks[0][0]
    if not all(_same(b[0], rows) for b in blocks):
        raise NoMatch("its blocks slice different tensors")
    if constant_ints(blocks[0][1]) != [0]:
        raise NoMatch("its first block does not start at row 0")
    if not all(_same(blocks[i + 1][1], blocks[i][2]) for i in range(len(blocks) - 1)):
        raise NoMatch("its blocks are not contiguous, in order")
    return concat, blocks


def _dense(match: tuple[ov.Node, list]) -> None:
    """Every expert on every row; each row keeps the expert whose block holds it."""
    concat, blocks = match
    rows = blocks[0][0]
    count = ops.gather(ops.shape_of(rows, "i64"), ops.constant(np.int64(0)), ops.constant(np.int64(0)))
    index = ops.unsqueeze(ops.range(ops.constant(np.int64(0)), count, ops.constant(np.int64(1)), output_type="i64"),
                          ops.constant(np.int64(1)))  # [rows, 1]
    base = concat.get_friendly_name()
    out = None
    for i, (_, start, _, matmul) in enumerate(blocks):
        full = ops.matmul(rows, matmul.input_value(1), False, bool(matmul.get_attributes().get("transpose_b")))
        full.set_friendly_name(f"{base}/dense_expert_{i}")
        if out is None:
            out = full.output(0)
            continue
        begin = ops.reshape(ops.convert(start, "i64"), ops.constant(np.array([1, 1], np.int64)), False)
        out = ops.select(ops.greater_equal(index, begin), full, out).output(0)
        out.get_node().set_friendly_name(f"{base}/dense_select_{i}")
    for name in concat.output(0).get_names():
        out.add_names({name})
    concat.output(0).replace(out)
    log.debug("dense-experts: %s (%d experts) now runs every expert on every row", describe_node(concat), len(blocks))


DENSE = Rule("dense-experts/expert-blocks", anchors=("Concat",), match=_expert_blocks, rewrite=_dense)


@register_pass
@dataclass(frozen=True)
class DenseExperts(Pass):
    """Replace data-dependent per-expert row blocks (MoE) by all-row MatMuls and a Select."""

    name: ClassVar[str] = "dense-experts"

    def run(self, model: ov.Model) -> PassResult:
        rewritten = DENSE.apply(model.get_ordered_ops())
        if rewritten:
            model.validate_nodes_and_infer_types()
        return PassResult(model, rewritten > 0)
