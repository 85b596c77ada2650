"""mask-positions: make attention masks and biases follow token positions, not cache slots.

transformers builds masks and position biases from index vectors and tables over cache
*slots*: ``q_idx = arange(q_len) + past_len``, ``kv_idx = arange(kv_len)``, or a precomputed
table sliced by slot. In a dynamic model slots and positions coincide. The NPU's static
contract separates them: the past is left-aligned in a buffer longer than it, the new token
sits in the last slot and the prefill is left-padded, so slot distances are not token
distances. A causal-only comparison is unaffected (slot order is position order, and padding
is masked by attention_mask); anything that measures a distance is wrong. Three rules:

* ``mask-positions/index-compare`` (sliding windows as transformers writes them, e.g.
  Mistral): a comparison (Greater/Less[Equal], Equal) of the q and kv index vectors, found up
  through Unsqueeze, Reshape, Squeeze, Convert, constant offsets, constant divisors and
  Floor, or of their difference
  with a constant (Gemma 3's language model as optimum-intel patches it: ``q_idx - kv_idx >=
  W``; its ``q_idx = arange(q_len) + past_len`` adds the past's length from the shapes, which
  the positions replace), or an Equal of the two each divided by a constant and floored
  (Llama 4's chunked attention: ``floor(q_idx / C) == floor(kv_idx / C)``, the chunk a
  position falls in, which no slot tells). Each comparison that measures a distance or a
  place (an index offset by a constant or divided by one, or a difference: a window) gets

      q_idx  <- position_ids[0]                              (this step's positions)
      kv_idx <- concat(arange(past_len), position_ids[0])    (left-aligned past, then this step)

  on its comparison paths only (the padding lookup ``attention_mask[kv_idx]`` indexes slots
  and keeps the slot vector). A causal comparison keeps its slots: slot order is position
  order, and it may fold a diagonal into its index vector (Gemma 3's triu compares with
  ``arange(past_len + 1, ...)``), which positions would drop.
* ``mask-positions/band-table`` (GPT-Neo's local layers): a constant boolean ``bias[M, M]``
  that is not plain causal (causal XOR causal shifted by the window), sliced
  ``bias[kv - q : kv, :kv]`` (row = query slot, column = key slot), becomes
  ``bias[q_pos][:, kv_pos]`` (two Gathers). A plain ``tril`` keeps its Slice.
* ``mask-positions/right-aligned-table`` (MPT's ALiBi): a table computed from constants only,
  whose last ``kv`` entries are taken along one axis (``table[..., M - kv:]``, e.g.
  ``slopes * arange(1 - M, 1)``): indexed by a key slot's distance from the newest slot. It
  becomes ``table[..., M - 1 - (p_last - p_k)]`` with key positions ``p = cumsum(mask) - 1``,
  which under the static contract are the token positions of every valid slot and never
  exceed ``p_last`` on pad slots (the index stays in range; pad slots are masked anyway).

* ``mask-positions/slot-positions`` (a rotary model without ``position_ids``, e.g.
  GPT-NeoX-Japanese, which takes its positions from ``cache_position = arange(q_len) +
  past_len`` or ``arange(past_len, past_len + q_len)``, slots again; or a model that reads
  ``cache_position`` as a position beside its ``position_ids``: Llama 4's attention temperature
  ``log1p(floor((cache_position + 1) / floor_scale))``). Where that vector enters a positional
  encoding (converted to floating point, as for the rotary MatMul or the temperature, or
  indexing a cos/sin table) it becomes the token positions (``position_ids``, else
  ``cumsum(mask)[-q_len:] - 1``), on that path alone; its other uses (a causal comparison, a
  window's difference, a mask table) keep the slots. The source's own runs from position 0
  have slots equal to positions, and so do the compile's references of a prompt from a
  position, which run over that many masked rows (`kvc.runtime.generate.greedy`); with
  ``floor_scale`` 8 every compile of Llama 4 was refused while slots stayed slots.

Positions come from ``position_ids`` when the model has it, else from the attention mask
(``cumsum(mask) - 1``: ALiBi models without position_ids). Models with none of these
patterns are left unchanged.
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

_COMPARE = {"Equal", "Greater", "GreaterEqual", "Less", "LessEqual"}
_THROUGH = {"Unsqueeze", "Reshape", "Squeeze", "Convert"}
_OFFSET = {"Add", "Subtract"}


def _index_source(out: ov.Output) -> tuple[ov.Output, list[ov.Node], bool]:
    """Walk up to the 1-D index vector: the vector, the nodes on the way (nearest first; not
    an added past length, `_past_length`, which the positions replace), and whether a
    constant offset was crossed."""
    offset, path = False, []
    for _ in range(16):
        node = out.get_node()
        kind = node.get_type_name()
        if kind == "Add" and _past_length(node.input_value(1)):  # slots to positions: not rebuilt
            out = node.input_value(0)
        elif kind in _THROUGH or (kind in _OFFSET and node.input_value(1).get_node().get_type_name() == "Constant"):
            offset |= kind in _OFFSET
            path.append(node)
            out = node.input_value(0)
        elif kind == "Floor" or (kind == "Divide" and node.input_value(1).get_node().get_type_name() == "Constant"
                                 and node.get_attributes().get("m_pythondiv", True)):
            # Llama 4's chunked attention: floor(q_idx / C) == floor(kv_idx / C), the chunk a
            # position falls in, which slots do not give
            offset |= kind == "Divide"
            path.append(node)
            out = node.input_value(0)
        else:
            break
    return out, path, offset


def _rebuild(path: list[ov.Node], source: ov.Output) -> ov.Output:
    """The same chain of ops applied to a new source vector."""
    out = source
    for node in reversed(path):
        kind = node.get_type_name()
        rest = [node.input_value(i) for i in range(1, node.get_input_size())]
        if kind == "Convert":
            out = ops.convert(out, node.get_output_element_type(0)).output(0)
        elif kind == "Unsqueeze":
            out = ops.unsqueeze(out, rest[0]).output(0)
        elif kind == "Squeeze":
            out = (ops.squeeze(out, rest[0]) if rest else ops.squeeze(out)).output(0)
        elif kind == "Reshape":
            out = ops.reshape(out, rest[0], bool(node.get_attributes()["special_zero"])).output(0)
        elif kind == "Add":
            out = ops.add(out, rest[0]).output(0)
        elif kind == "Divide":  # rounding down, as matched (`_index_source`)
            out = ops.divide(out, rest[0]).output(0)
        elif kind == "Floor":
            out = ops.floor(out).output(0)
        else:  # Subtract
            out = ops.subtract(out, rest[0]).output(0)
    return out


def _length(out: ov.Output) -> int | None:
    shape = out.get_partial_shape()
    if shape.rank.is_static and shape.rank.get_length() == 1 and shape[0].is_static:
        return shape[0].get_length()
    return None



def _constant_expr(out: ov.Output, limit: int = 64, shapes: bool = False) -> bool:
    """Whether `out` depends on no input or state (a table OpenVINO could fold), looking at
    most `limit` nodes up; with `shapes`, on no input's values: a ShapeOf is a constant (the
    static shapes make it one)."""
    stack, seen = [out.get_node()], set()
    while stack:
        node = stack.pop()
        if node.get_type_name() in ("Parameter", "ReadValue") or len(seen) > limit:
            return False
        if node.get_friendly_name() in seen or (shapes and node.get_type_name() in ("ShapeOf", "Constant")):
            continue
        seen.add(node.get_friendly_name())
        stack.extend(v.get_node() for v in node.input_values())
    return True


def _past_length(out: ov.Output) -> bool:
    """Whether `out` is a scalar computed from shapes alone: added to ``arange(q_len)`` it is
    the past's length, ``q_idx = arange(q_len) + past_len`` (Gemma 3's language model as
    optimum-intel patches it), the slot offset that the positions replace."""
    shape = out.get_partial_shape()
    return (shape.is_static and int(np.prod(shape.to_shape())) == 1 and out.get_node().get_type_name() != "Constant"
            and _constant_expr(out, shapes=True))


def _slice_axes(node: ov.Node) -> tuple[list[int], list[int]]:
    """(normalized axes, steps) of a Slice with constant axes and steps."""
    rank = node.get_input_partial_shape(0).rank
    if rank.is_dynamic:
        raise NoMatch("its input has a dynamic rank")
    r = rank.get_length()
    steps = constant_ints(node.input_value(3))
    axes = constant_ints(node.input_value(4)) if node.get_input_size() > 4 else list(range(len(steps or [])))
    if steps is None or axes is None:
        raise NoMatch("its steps or axes are not constants")
    return [a % r for a in axes], steps


def _difference(node: ov.Node) -> ov.Node | None:
    """The Subtract of `Compare(q_idx - kv_idx, W)` (either way round; W a Constant, the
    difference found up through Unsqueeze, Reshape, Squeeze and Convert), else None."""
    for i in (0, 1):
        if node.input_value(1 - i).get_node().get_type_name() != "Constant":
            continue
        out = node.input_value(i)
        while out.get_node().get_type_name() in _THROUGH:
            out = out.get_node().input_value(0)
        if out.get_node().get_type_name() == "Subtract":
            return out.get_node()
    return None


def _index_compare(node: ov.Node, steps: int, mask_len: int):
    """A comparison of the q index vector (this step's length) with the kv one (the mask's),
    or of their difference with a constant (`_difference`): (the node whose two inputs are the
    index vectors, which side is q, both sides as (vector, path, offset crossed), whether it
    measures a distance, i.e. a window: a side offset by a constant, or a difference)."""
    difference = _difference(node)
    node = difference or node
    sides = [_index_source(node.input_value(i)) for i in (0, 1)]
    lengths = [_length(src) for src, _, _ in sides]
    if None in lengths or not all(src.get_element_type().is_integral() for src, _, _ in sides):
        raise NoMatch("a side is not a static 1-D integer index vector (through Unsqueeze, Reshape, "
                      "Squeeze, Convert and constant offsets)")
    if sorted(lengths) != sorted([steps, mask_len]):
        raise NoMatch(f"index vectors of lengths {lengths}, not this step's {steps} and the mask's {mask_len}")
    # The q vector has this step's length, the kv vector the mask's (equal in a prefill,
    # where both become the positions anyway).
    q_side = 0 if lengths[0] == steps and (lengths[0] != lengths[1] or sides[0][2]) else 1
    return node, q_side, sides, sides[0][2] or sides[1][2] or difference is not None


def _band_table(node: ov.Node, steps: int, mask_len: int) -> ov.Node:
    """A Slice of a constant [.., M, M] boolean table that is not plain causal, over its last
    two axes, to [.., steps, mask_len]: rows are query slots, columns key slots."""
    src = node.input_value(0).get_node()
    if src.get_type_name() != "Constant" or src.get_output_element_type(0) != ov.Type.boolean:
        raise NoMatch("it does not slice a boolean constant")
    axes, step = _slice_axes(node)
    shape, out = list(src.get_output_shape(0)), node.get_output_partial_shape(0)
    r = len(shape)
    if r < 2 or sorted(axes) != [r - 2, r - 1] or set(step) != {1} or shape[-1] != shape[-2]:
        raise NoMatch(f"it is not a step-1 slice of a square table over its last two axes (table {shape})")
    if not out.is_static or list(out.to_shape())[-2:] != [steps, mask_len]:
        raise NoMatch(f"its output {out} is not [.., {steps}, {mask_len}] (this step's rows, the mask's columns)")
    table = np.asarray(src.get_data()).reshape(-1, shape[-2], shape[-1])
    if np.array_equal(table, np.broadcast_to(np.tril(np.ones(shape[-2:], bool)), table.shape)):
        raise NoMatch("the table is plain causal (tril): slot order is position order")
    return node


def _right_aligned_table(node: ov.Node, mask_len: int) -> tuple[ov.Node, int]:
    """A Slice `table[..., M - mask_len:]` (to the end, step 1, one axis) of a table computed
    from constants only: (the Slice, its axis)."""
    axes, step = _slice_axes(node)
    if len(axes) != 1 or step != [1]:
        raise NoMatch("it is not a step-1 slice along one axis")
    axis = axes[0]
    src_shape, out_shape = node.get_input_partial_shape(0), node.get_output_partial_shape(0)
    if not (src_shape[axis].is_static and out_shape.rank.is_static and out_shape[axis].is_static):
        raise NoMatch("its sliced axis is not static")
    table_len, stop = src_shape[axis].get_length(), constant_ints(node.input_value(2))
    if out_shape[axis].get_length() != mask_len or table_len < mask_len:
        raise NoMatch(f"it takes {out_shape[axis].get_length()} of {table_len} entries, not the mask's {mask_len}")
    if stop is None or stop[0] < table_len:
        raise NoMatch("it does not run to the end of the table")
    if not _constant_expr(node.input_value(0)):
        raise NoMatch("the table depends on an input")
    return node, axis


def _encoding_uses(out: ov.Output) -> list[tuple[ov.Input, list[ov.Node]]]:
    """Where the index vector `out` enters a positional encoding: followed down through
    Unsqueeze, Reshape, Squeeze and constant offsets on every path (a shared node forks it),
    each input that turns it into floating point (a Convert to f32: the rotary MatMul,
    sinusoids) or indexes a floating-point table (a Gather of cos/sin), with the nodes on the
    way (nearest the input first, as `_rebuild` takes them). Every other use keeps the slots:
    a comparison (causal order, a window's difference) or a boolean mask table."""
    uses, stack = [], [(out, [])]
    while stack:
        current, path = stack.pop()
        for target in current.get_target_inputs():
            node = target.get_node()
            kind = node.get_type_name()
            if kind == "Convert" and node.get_output_element_type(0).is_real():
                uses.append((target, path))
            elif kind == "Gather" and target.get_index() == 1 and node.get_input_element_type(0).is_real():
                uses.append((target, path))
            elif len(path) < 16 and (kind in ("Unsqueeze", "Reshape", "Squeeze") and target.get_index() == 0 or (
                    kind in _OFFSET and target.get_index() == 0
                    and node.input_value(1).get_node().get_type_name() == "Constant")):
                stack.append((node.output(0), [node, *path]))
    return uses


def _slot_positions(node: ov.Node, steps: int) -> tuple[ov.Node, list[tuple[ov.Input, list[ov.Node]]]]:
    """transformers' ``cache_position``: this step's `steps` slot indices, ``arange(0, steps) +
    past_len`` (an integer Add of a Range from 0 by 1 and a computed scalar) or
    ``arange(past_len, past_len + steps)`` (a Range from a computed scalar by 1), and where it
    enters a positional encoding (`_encoding_uses`)."""
    if not node.get_output_element_type(0).is_integral():
        raise NoMatch("it is not an integer index vector")
    if _length(node.output(0)) != steps:
        raise NoMatch(f"it is not this step's {steps} indices")
    if node.get_type_name() == "Range":
        start, step = node.input_value(0), constant_ints(node.input_value(2))
        if step != [1] or _constant_expr(start):
            raise NoMatch("it is not a Range by 1 from a computed start (the past's length)")
    else:
        sides = [node.input_value(i) for i in (0, 1)]
        ranges = [i for i, side in enumerate(sides) if side.get_node().get_type_name() == "Range"]
        if len(ranges) != 1:
            raise NoMatch("it does not add one Range")
        rng, offset = sides[ranges[0]].get_node(), sides[1 - ranges[0]]
        if constant_ints(rng.input_value(0)) != [0] or constant_ints(rng.input_value(2)) != [1]:
            raise NoMatch("its Range does not count from 0 by 1")
        shape = offset.get_partial_shape()
        if not shape.is_static or int(np.prod(list(shape.to_shape()))) != 1 or _constant_expr(offset):
            raise NoMatch("the Range is not offset by a computed scalar (the past's length)")
    uses = _encoding_uses(node.output(0))
    if not uses:
        raise NoMatch("it enters no positional encoding (comparisons keep slot order, which is position order)")
    return node, uses


@register_pass
@dataclass(frozen=True)
class MaskPositions(Pass):
    """Rewrite slot-indexed masks and position biases to token positions (static batch-1 models)."""

    name: ClassVar[str] = "mask-positions"
    requires: ClassVar[tuple[str, ...]] = ("static",)

    def run(self, model: ov.Model) -> PassResult:
        ports = {p.get_any_name(): p for p in model.inputs}
        token = ports.get("position_ids") or ports.get("input_ids") or ports.get("inputs_embeds")
        if token is None or ("position_ids" not in ports and "attention_mask" not in ports):
            return PassResult(model, False)
        steps = token.get_shape()[-1 if token is ports.get("position_ids") else 1]  # [1, S], [3, 1, S], [1, S, H]
        mask_len = ports["attention_mask"].get_shape()[-1] if "attention_mask" in ports else steps
        nodes = model.get_ordered_ops()
        compares = []
        if "position_ids" in ports:
            compares = Rule("mask-positions/index-compare", anchors=tuple(sorted(_COMPARE)),
                            match=lambda n: _index_compare(n, steps, mask_len)).matches(nodes)
            # a causal comparison means the same on slots and positions, and may fold a
            # diagonal into its index vector (Gemma 3's triu: arange(past + 1, ...)): kept
            compares = [c for c in compares if c[-1]]
        bands = Rule("mask-positions/band-table", anchors=("Slice",),
                     match=lambda n: _band_table(n, steps, mask_len)).matches(nodes)
        right = slots = []
        if "attention_mask" in ports:
            right = Rule("mask-positions/right-aligned-table", anchors=("Slice",),
                         match=lambda n: _right_aligned_table(n, mask_len)).matches(nodes)
        if "attention_mask" in ports:
            slots = Rule("mask-positions/slot-positions", anchors=("Add", "Range"),
                         match=lambda n: _slot_positions(n, steps)).matches(nodes)
        if not (compares or bands or right or slots):
            log.debug("mask-positions: no slot-indexed window or table; unchanged")
            return PassResult(model, False)
        positions, kv_positions, counts, mask = _positions(ports, steps, mask_len, need_counts=bool(right))
        for node, q_side, sides, _ in compares:
            for i, (src, path, _) in enumerate(sides):
                new_src = positions if i == q_side else kv_positions
                new_src = ops.convert(new_src, src.get_element_type()).output(0)
                node.input(i).replace_source_output(_rebuild(path, new_src))
            log.debug("mask-positions: %s now compares positions", describe_node(node))
        for node in bands:
            rank = node.get_output_partial_shape(0).rank.get_length()
            rows = ops.gather(node.input_value(0), positions, ops.constant(np.int64(rank - 2)))
            table = ops.gather(rows, kv_positions, ops.constant(np.int64(rank - 1)))
            table.set_friendly_name(f"{node.get_friendly_name()}/by_position")
            node.output(0).replace(table.output(0))
            log.debug("mask-positions: %s now looks its table up by position", describe_node(node))
        for node, axis in right:
            # slot k's entry M - kv + k (its distance from the newest slot) becomes
            # M - 1 - (p_last - p_k) = counts_k - total + M - 1 (counts_last = total).
            table_len = node.get_input_partial_shape(0)[axis].get_length()
            total = ops.reduce_sum(mask, ops.constant(np.int64(0)), keep_dims=True)
            index = ops.add(ops.subtract(counts, total), ops.constant(np.array([table_len - 1], np.int64)))
            gathered = ops.gather(node.input_value(0), index, ops.constant(np.int64(axis)))
            gathered.set_friendly_name(f"{node.get_friendly_name()}/by_position")
            node.output(0).replace(gathered.output(0))
            log.debug("mask-positions: %s now indexes its table by position distance", describe_node(node))
        for node, uses in slots:
            # the slots of this step's rows, M - q .. M - 1, are the token positions counts - 1
            by_position = ops.convert(positions, node.get_output_element_type(0))
            by_position.set_friendly_name(f"{node.get_friendly_name()}/by_position")
            for use, path in uses:
                use.replace_source_output(_rebuild(path, by_position.output(0)))
            log.debug("mask-positions: %s now gives token positions to %d encodings", describe_node(node), len(uses))
        model.validate_nodes_and_infer_types()
        return PassResult(model, True)


def _positions(ports: dict, steps: int, mask_len: int, need_counts: bool):
    """(q positions [steps], kv positions [mask_len], counts = cumsum(mask) or None, mask or None)."""
    counts = mask = None
    if need_counts or "position_ids" not in ports:
        mask = ops.reshape(ops.convert(ports["attention_mask"], "i64"), ops.constant(np.array([mask_len], np.int64)),
                           False)
        counts = ops.cumsum(mask, ops.constant(np.int64(0)))  # valid slots up to and including k
        counts.set_friendly_name("mask_positions/counts")
    if "position_ids" in ports:
        given = ports["position_ids"]
        if given.get_partial_shape().rank.get_length() == 3:  # mRoPE [3, 1, S]: a text's positions, every row alike
            given = ops.gather(given, ops.constant(np.int64(0)), ops.constant(np.int64(0))).output(0)
        positions = ops.reshape(given, ops.constant(np.array([steps], np.int64)), False)
        past = ops.range(ops.constant(np.int64(0)), ops.constant(np.int64(mask_len - steps)),
                         ops.constant(np.int64(1)), output_type="i64")
        kv_positions = ops.concat([past, positions], 0)
    else:  # p_k = counts_k - 1
        kv_positions = ops.subtract(counts, ops.constant(np.array([1], np.int64)))
        positions = ops.slice(kv_positions, ops.constant(np.array([mask_len - steps], np.int64)),
                              ops.constant(np.array([mask_len], np.int64)), ops.constant(np.array([1], np.int64)))
    positions.set_friendly_name("mask_positions/q")
    kv_positions.set_friendly_name("mask_positions/kv")
    return positions, kv_positions, counts, mask
