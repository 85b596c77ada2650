"""mask-positions: make a sliding-window attention mask follow positions, not cache slots.

transformers builds its masks from index vectors: ``q_idx = arange(q_len) + past_len`` and
``kv_idx = arange(kv_len)``, i.e. cache *slots*; a sliding window compares them
(``kv_idx > q_idx - W``). In a dynamic model slots and positions coincide. The NPU's static
contract separates them: the past is left-aligned in a buffer longer than it, the new
token sits in the last slot and the prefill is left-padded, so slot distances are not
token distances, and a window on slots masks the wrong tokens (a causal-only mask is
unaffected: slot order is position order, and padding is masked by attention_mask).

On a static model (batch 1, after static-shape) the rewrite replaces the two vectors by what
they stand for:

    q_idx  <- position_ids[0]                                (this step's positions)
    kv_idx <- concat(arange(past_len), position_ids[0])      (left-aligned past, then this step)

Vectors are found from the mask comparisons (Greater/Less[Equal]; the rule
`mask-positions/index-compare`) up through Unsqueeze,
Reshape, Convert and constant offsets, and replaced on those comparison paths only: the
padding lookup ``attention_mask[kv_idx]`` indexes slots and keeps the slot vector. The pass
applies only when some comparison offsets an index by a constant (a window), and leaves
other models unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult, describe_node
from kvc.passes.framework.registry import register_pass
from kvc.passes.framework.rules import NoMatch, Rule

log = logging.getLogger(__name__)

_COMPARE = {"Greater", "GreaterEqual", "Less", "LessEqual"}
_THROUGH = {"Unsqueeze", "Reshape", "Squeeze", "Convert"}
_OFFSET = {"Add", "Subtract"}


def _index_source(out: ov.Output) -> tuple[ov.Output, list[ov.Node], bool]:
    """Walk up to the 1-D index vector: the vector, the nodes on the way (nearest first), and
    whether a constant offset was crossed."""
    offset, path = False, []
    for _ in range(16):
        node = out.get_node()
        kind = node.get_type_name()
        if kind in _THROUGH or (kind in _OFFSET and node.input_value(1).get_node().get_type_name() == "Constant"):
            offset |= kind in _OFFSET
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
        else:  # Subtract
            out = ops.subtract(out, rest[0]).output(0)
    return out


def _length(out: ov.Output) -> int | None:
    shape = out.get_partial_shape()
    if shape.rank.is_static and shape.rank.get_length() == 1 and shape[0].is_static:
        return shape[0].get_length()
    return None


@register_pass
@dataclass(frozen=True)
class MaskPositions(Pass):
    """Rewrite slot-index sliding-window masks to position-based ones (static batch-1 models)."""

    name: ClassVar[str] = "mask-positions"

    requires: ClassVar[tuple[str, ...]] = ("static",)

    def run(self, model: ov.Model) -> PassResult:
        ports = {p.get_any_name(): p for p in model.inputs}
        if "position_ids" not in ports or "input_ids" not in ports and "inputs_embeds" not in ports:
            return PassResult(model, False)
        pos_port = ports["position_ids"]
        steps = pos_port.get_shape()[-1]
        mask_len = ports["attention_mask"].get_shape()[-1] if "attention_mask" in ports else steps
        rule = Rule("mask-positions/index-compare", anchors=tuple(sorted(_COMPARE)),
                    match=lambda node: _index_compare(node, steps, mask_len))
        found = rule.matches(model.get_ordered_ops())
        if not any(offset for *_, offset in found):
            log.debug("mask-positions: no sliding-window comparison found; unchanged")
            return PassResult(model, False)
        positions = ops.reshape(pos_port, ops.constant(np.array([steps], np.int64)), False)
        positions.set_friendly_name("mask_positions/q")
        past = ops.range(ops.constant(np.int64(0)), ops.constant(np.int64(mask_len - steps)),
                         ops.constant(np.int64(1)), output_type="i64")
        kv_positions = ops.concat([past, positions], 0)
        kv_positions.set_friendly_name("mask_positions/kv")
        for node, q_side, sides, _ in found:
            for i, (src, path, _) in enumerate(sides):
                new_src = positions if i == q_side else kv_positions
                new_src = ops.convert(new_src, src.get_element_type()).output(0)
                node.input(i).replace_source_output(_rebuild(path, new_src))
            log.debug("mask-positions: %s now compares positions", describe_node(node))
        model.validate_nodes_and_infer_types()
        return PassResult(model, True)


def _index_compare(node: ov.Node, steps: int, mask_len: int):
    """A comparison of the q index vector (this step's length) with the kv one (the mask's):
    (node, which side is q, both sides as (vector, path, offset crossed), whether any side
    is offset by a constant, i.e. a window)."""
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
    return node, q_side, sides, sides[0][2] or sides[1][2]
