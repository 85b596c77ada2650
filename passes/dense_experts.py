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
starting at constant 0 and each starting where the previous one stops.

Sparse MoE layers that route rows one expert at a time (transformers 4's Mixtral, PhiMoE,
Qwen2-MoE and DBRX blocks, as optimum-intel exports them under transformers 4.x) pick each
expert's rows with NonZero and add its output back with index_add:

    slot, row = NonZero(Transpose(OneHot(topk_indices))[e])      # mask [k, N]: (slot, row) pairs
    out = ScatterElementsUpdate_sum(out, row, expert_e(X[row]) * weights[row, slot])

The pair count is data, so nothing static can bound it. The rewrite lists static tuples in
NonZero's place and drops, with a Select, the updates of those NonZero would not have listed:

* one pair per row, where the mask is an expert's plane of a OneHot of TopK indices (a row's k
  indices are distinct, so at most one slot holds expert e) and the scatter adds into the
  pair's row: the row's slot, or slot 0 where none holds e;

      slot = ReduceSum(mask * [0..k-1]);  row = Range(N);  update = Select(routed, update, 0)

* otherwise every index tuple of the mask in row-major order, as NonZero lists them (PhiMoE's
  sparsemixer concatenates two TopKs, whose indices nothing in the graph shows distinct): k
  pairs a row, twice the work of one pair at k = 2.

Each listed tuple's update is computed as before and added to the same row in the same order
among those of its row; an unlisted one adds 0, which changes nothing (and is selected, not
multiplied, so a non-finite value in an expert a row is not routed to cannot leak). The terms
are the source's: OpenVINO CPU, whose MatMul computes a row the same whatever the row count,
gives the same bits; numpy's BLAS rounds a row an ulp apart by the row count. Applies
when every use of the tuples is tuple by tuple (NonZero's output split into its indices,
elementwise ops, Gathers indexed by them, MatMuls of their rows) and ends in one summing
scatter on axis 0; other models are unchanged.
Runs on dynamic models, before static-shape.
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


# How the index tuples of a NonZero may be used (ops, and the ports through which they may read
# them) for every tuple's update to depend on that tuple alone; elementwise ops read them anywhere.
_ROWWISE = {"Split": (0,), "Squeeze": (0,), "Unsqueeze": (0,), "Convert": (0,), "Reshape": (0,),
            "Broadcast": (0,), "Gather": (1,), "MatMul": (0,)}
_ELEMENTWISE = {"Multiply", "Add", "Subtract", "Divide", "Swish", "Sigmoid", "Gelu", "Relu", "Tanh",
                "Clamp", "HSwish", "Exp", "Negative"}


def _distinct_slots(mask: ov.Output) -> bool:
    """Whether `mask` ([k, N]) is one expert's plane of a OneHot of TopK indices [N, k]: the k
    indices of a row are distinct, so each column holds at most one nonzero."""
    node = mask.get_node()
    if node.get_type_name() != "Gather" or constant_ints(node.input_value(2)) != [0] \
            or node.get_input_partial_shape(1).rank != 0:
        return False
    perm = node.input_value(0).get_node()
    if perm.get_type_name() != "Transpose" or constant_ints(perm.input_value(1)) != [2, 1, 0]:
        return False
    onehot = perm.input_value(0).get_node()
    if onehot.get_type_name() != "OneHot" or onehot.get_attributes()["axis"] not in (-1, 2):
        return False
    indices = onehot.input_value(0)
    if indices.get_node().get_type_name() == "Convert":
        indices = indices.get_node().input_value(0)
    topk = indices.get_node()
    return topk.get_type_name() == "TopK" and indices.get_index() == 1 and \
        indices.get_partial_shape().rank == 2 and topk.get_attributes()["axis"] in (-1, 1)


def _indexed_by_row(scatter: ov.Node, nonzero: ov.Node) -> bool:
    """Whether the scatter's indices are the pairs' row (NonZero's second index), reshaped."""
    value = scatter.input_value(1)
    while value.get_node().get_type_name() in ("Broadcast", "Reshape", "Convert", "Squeeze", "Unsqueeze"):
        value = value.get_node().input_value(0)
    split = value.get_node()
    return split.get_type_name() == "Split" and value.get_index() == 1 and split.get_output_size() == 2 \
        and constant_ints(split.input_value(1)) == [0] and split.input_value(0).get_node() is nonzero


def _routed_rows(nonzero: ov.Node) -> tuple[ov.Node, ov.Node, bool]:
    """(NonZero, the summing ScatterElementsUpdate its tuples index, whether one pair per row
    suffices) of an expert routed by rows."""
    if nonzero.get_input_partial_shape(0).rank.is_dynamic:
        raise NoMatch("its input's rank is not known")
    sinks, stack, seen = [], [nonzero], {nonzero}
    while stack:
        for out in stack.pop().outputs():
            for target in out.get_target_inputs():
                user, port = target.get_node(), target.get_index()
                kind = user.get_type_name()
                if kind == "ScatterElementsUpdate" and port in (1, 2):
                    sinks.append(user)
                    continue
                if kind not in _ELEMENTWISE and port not in _ROWWISE.get(kind, ()):
                    raise NoMatch(f"its indices reach {describe_node(user)} (port {port}), which is not row by row")
                if kind == "Split" and (user.input_value(0).get_node() is not nonzero
                                        or constant_ints(user.input_value(1)) != [0]):
                    raise NoMatch(f"{describe_node(user)} splits other than NonZero's tuples into their indices")
                if user not in seen:
                    seen.add(user)
                    stack.append(user)
    scatters = {s.get_friendly_name(): s for s in sinks}
    if len(scatters) != 1:
        raise NoMatch(f"its indices index {len(scatters)} scatters, not one")
    (scatter,) = scatters.values()
    if str(scatter.get_attributes().get("reduction", "none")).lower() != "sum" or \
            constant_ints(scatter.input_value(3)) != [0] or scatter.input_value(0).get_node() in seen:
        raise NoMatch(f"{describe_node(scatter)} is not a sum on axis 0 into rows it does not read")
    if scatter.get_input_partial_shape(2).rank.is_dynamic:
        raise NoMatch(f"{describe_node(scatter)}'s updates have no known rank")
    per_row = _distinct_slots(nonzero.input_value(0)) and _indexed_by_row(scatter, nonzero)
    return nonzero, scatter, per_row


def _every_index(mask: ov.Output) -> tuple[ov.Output, ov.Output]:
    """(every index tuple of `mask` in row-major order, as NonZero lists them: [rank, size];
    whether each is nonzero: [size])."""
    shape = ops.shape_of(mask, "i64")
    rank = mask.get_partial_shape().rank.get_length()
    zero, one, flat = ops.constant(np.int64(0)), ops.constant(np.int64(1)), ops.constant(np.array([1, -1], np.int64))
    axes = []
    for a in range(rank):
        size = ops.gather(shape, ops.constant(np.int64(a)), zero)
        along = ops.reshape(ops.range(zero, size, one, output_type="i64"),
                            ops.constant(np.array([-1 if b == a else 1 for b in range(rank)], np.int64)), False)
        axes.append(ops.reshape(ops.broadcast(along, shape), flat, False))
    hot = ops.not_equal(mask, ops.convert_like(zero, mask))
    return ops.concat(axes, 0).output(0), ops.reshape(hot, ops.constant(np.array([-1], np.int64)), False).output(0)


def _one_pair_per_row(mask: ov.Output) -> tuple[ov.Output, ov.Output]:
    """(one (slot, row) pair per row of `mask` [k, N], its slot or 0: [2, N]; whether the row
    has one: [N]), for a mask with at most one nonzero per column."""
    zero, one = ops.constant(np.int64(0)), ops.constant(np.int64(1))
    shape = ops.shape_of(mask, "i64")
    hot = ops.convert(ops.not_equal(mask, ops.convert_like(zero, mask)), "i64")  # [k, N] of 0 and 1
    slots = ops.unsqueeze(ops.range(zero, ops.gather(shape, zero, zero), one, output_type="i64"), one)  # [k, 1]
    slot = ops.reduce_sum(ops.multiply(hot, slots), zero, keep_dims=True)  # [1, N]
    rows = ops.unsqueeze(ops.range(zero, ops.gather(shape, one, zero), one, output_type="i64"), zero)  # [1, N]
    routed = ops.greater(ops.reduce_sum(hot, zero, keep_dims=False), zero)
    return ops.concat([slot, rows], 0).output(0), routed.output(0)


def _route_every_row(match: tuple[ov.Node, ov.Node, bool]) -> None:
    """NonZero's tuples replaced by static ones; the updates of those it did not list are 0."""
    nonzero, scatter, per_row = match
    tuples, routed = (_one_pair_per_row if per_row else _every_index)(nonzero.input_value(0))
    tuples = ops.convert(tuples, nonzero.get_output_element_type(0))
    tuples.set_friendly_name(f"{nonzero.get_friendly_name()}/" + ("one_pair_per_row" if per_row else "every_index"))
    nonzero.output(0).replace(tuples.output(0))
    updates = scatter.input_value(2)
    rank = updates.get_partial_shape().rank.get_length()
    routed = ops.reshape(routed, ops.constant(np.array([-1] + [1] * (rank - 1), np.int64)), False)
    kept = ops.select(routed, updates, ops.convert_like(ops.constant(np.float32(0)), updates))
    kept.set_friendly_name(f"{scatter.get_friendly_name()}/routed_rows")
    scatter.input(2).replace_source_output(kept.output(0))
    log.debug("dense-experts: %s now lists %s", describe_node(nonzero),
              "one pair per row" if per_row else "every index")


ROUTED = Rule("dense-experts/routed-rows", anchors=("NonZero",), match=_routed_rows, rewrite=_route_every_row)


@register_pass
@dataclass(frozen=True)
class DenseExperts(Pass):
    """Replace data-dependent per-expert rows (MoE row blocks, NonZero-routed rows) by all rows
    and a Select."""

    name: ClassVar[str] = "dense-experts"

    def run(self, model: ov.Model) -> PassResult:
        rewritten = DENSE.apply(model.get_ordered_ops()) + ROUTED.apply(model.get_ordered_ops())
        if rewritten:
            model.validate_nodes_and_infer_types()
        return PassResult(model, rewritten > 0)
