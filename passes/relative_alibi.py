"""relative-alibi: ALiBi biases measured from the newest token, not from the first.

BLOOM and Falcon's ALiBi variant build the bias from the attention mask as transformers'
``build_alibi_tensor`` writes it:

    positions = (cumsum(attention_mask, -1) - 1) * attention_mask          # [B, K], int
    bias = slopes[h] * float(positions[b, k])                              # added to every query row

Softmax is invariant to a constant added to each row, so the bias is exact only relative to
its row, but as written it grows with the absolute position: at 1000 tokens a head of slope
0.25 adds 250 to scores of a few units. In bf16 arithmetic (the CPU's default) 250 has a unit
in the last place of 2, and the scores the bias lands on lose every bit that separates them:
kvc's static models at the CPU's bf16 default drifted 5x further from the f32 source than
OpenVINO's own stateful bf16 run at 256 tokens (NRMSE 0.010 against 0.0021), and a correct
compile at ``--max-prompt-len 256`` was refused for it. The stateful model's fused SDPA kernel
adds the bias at f32; kvc's static models write attention out (group-attention) and the CPU
plugin runs that at bf16.

The rule subtracts each sequence's newest position before the positions become floating point:

    positions <- positions - max(positions, -1)                            # <= 0, exact in integers

a constant per (batch, head) row, so every row's Softmax is unchanged in exact arithmetic, and
the bias is near 0 where the weights are (the newest tokens), small in every model call (a
generate step exactly relative; a prefill chunk of Q rows at most slope x (Q - 1) from its row).
Measured on the bloom fixture at the CPU's bf16 default (`python scripts/accuracy.py OUT`; NRMSE against the f32
source, median): 0.0039 -> 0.0022 at 255 tokens, 0.0080 -> 0.0021 at 512, 0.0157 -> 0.0020 at
1000, where OpenVINO's stateful bf16 run gives 0.0019, 0.0077, 0.0154.

The rule matches only that dataflow: a Multiply of a floating-point constant (the slopes) by
integer positions converted to floating point, the positions computed from a CumSum over the
last axis of a rank-2 tensor through element-wise integer arithmetic and Unsqueeze (which keep
that axis last), and the product reaching attention only as an additive mask: through
reshapes, conversions and a masked fill (Select) into ScaledDotProductAttention's mask input,
or into an Add whose result goes only to a Softmax over the last axis (multiplied or divided
on the way by a constant that is one value along that axis: Falcon's 1 / sqrt(head size)).

Falcon's ALiBi (transformers' ``slopes.bfloat16() x positions``) makes the positions bf16,
exact only to 256: past that the source rounds the absolute positions, and shifted ones would
round otherwise (another function, not a constant per row). Its bias is shifted where it
becomes f32 again instead (single-use reshapes after the product, then a Convert to f32), by
its largest key's bias, ``bias - max(bias, -1)``: bf16 values whose difference f32 holds.
Measured on falcon_alibi (32 heads, as Falcon-RW-1B) given 1024 positions, compiled at the
CPU's bf16 default with ``--max-prompt-len 768`` (median NRMSE against the f32 source,
`scripts/accuracy.py`): 0.0142 -> 0.0022 at 255 tokens, 0.0233 -> 0.0019 at 512, 0.0210 ->
0.0019 at 760, where OpenVINO's stateful bf16 run gives 0.0104, 0.0157, 0.0145; without the
rule the blobs' far probe at position 894 (step error 0.291, past 0.25) was refused.

A misfire (a reshape that moved the key axis) would shift each row by more than a constant,
which the compile's check of the IR against the source refuses. MPT's ALiBi (``slopes x arange(1 - M, 1)``) is measured from
the newest slot already (mask-positions' right-aligned-table).
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

_LAYOUT = ("Reshape", "Unsqueeze", "Squeeze", "Convert")  # carry the bias, any input
_FIRST_INPUT = ("ConvertLike", "Broadcast")  # carry the bias in input 0 only
_MAX_PATH = 12  # nodes between the slopes' Multiply and the attention it biases
# The float types positions may become: exact for every integer to 2^24 (f32). Falcon's become
# bf16, exact only to 256; past that its bias is slopes x round(position), and shifted positions
# would round otherwise: its bias is shifted once it is f32 (`_shift_bias`).
_EXACT_POSITIONS = (ov.Type.f32, ov.Type.f64)


def _axis_last(node: ov.Node) -> bool:
    """A CumSum over the last axis of a rank-2 input (the mask's key axis)."""
    rank = node.get_input_partial_shape(0).rank
    axis = node.input_value(1).get_node()
    if rank.is_dynamic or rank.get_length() != 2 or axis.get_type_name() != "Constant":
        return False
    return int(np.asarray(axis.get_data()).reshape(-1)[0]) in (-1, 1)


def _positions_from_cumsum(value: ov.Output, depth: int = 0) -> bool:
    """Whether the integer `value` is computed from a CumSum over a mask's key axis by
    element-wise arithmetic and Unsqueeze that keep that axis last."""
    node = value.get_node()
    kind = node.get_type_name()
    if kind == "CumSum":
        return _axis_last(node)
    if depth > 6:
        return False
    if kind == "Unsqueeze":
        rank = node.get_output_partial_shape(0).rank
        axes = node.input_value(1).get_node()
        if rank.is_dynamic or axes.get_type_name() != "Constant":
            return False
        last = rank.get_length() - 1
        if any(int(a) in (-1, last) for a in np.asarray(axes.get_data()).reshape(-1)):
            return False
        return _positions_from_cumsum(node.input_value(0), depth + 1)
    if kind == "Convert":
        return node.get_input_element_type(0).is_integral() and _positions_from_cumsum(node.input_value(0), depth + 1)
    if kind in ("Add", "Subtract", "Multiply"):
        return any(_positions_from_cumsum(v, depth + 1) for v in node.input_values())
    return False


def _softmax_over_last(node: ov.Node) -> bool:
    """A Softmax over the last axis (the keys: a constant per row leaves it unchanged)."""
    if node.get_type_name() != "Softmax":
        return False
    rank = node.get_output_partial_shape(0).rank
    axis = int(node.get_attributes()["axis"])
    return rank.is_static and axis in (-1, rank.get_length() - 1)


def _scaled_per_row(node: ov.Node, port: int) -> bool:
    """The bias multiplied or divided (input 0) by a constant that is one value along the last
    axis (Falcon's 1 / sqrt(head size)): a constant per row stays one."""
    if node.get_type_name() not in ("Multiply", "Divide") or (node.get_type_name() == "Divide" and port != 0):
        return False
    other = node.input_value(1 - port).get_node()
    if other.get_type_name() != "Constant":
        return False
    shape = list(other.get_output_shape(0))
    return not shape or shape[-1] == 1


def _only_additive_mask(value: ov.Output, seen: int = 0) -> int:
    """The attention masks `value` reaches, each only as an additive mask (module docstring);
    raises NoMatch at any other use."""
    reached = 0
    for target in value.get_target_inputs():
        node, port = target.get_node(), target.get_index()
        kind = node.get_type_name()
        if seen > _MAX_PATH:
            raise NoMatch("the bias does not reach attention within a few layout nodes")
        if kind == "ScaledDotProductAttention" and port == 3:
            reached += 1
        elif kind == "Add" and all(_softmax_over_last(t.get_node()) for t in node.output(0).get_target_inputs()):
            reached += 1
        elif kind in ("Convert", "ConvertLike") and node.get_output_element_type(0) not in _EXACT_POSITIONS:
            raise NoMatch(f"the bias is rounded to {node.get_output_element_type(0).get_type_name()} at "
                          f"{describe_node(node)}: the source rounds its absolute bias, a shifted one rounds otherwise")
        elif kind in _LAYOUT or (kind in _FIRST_INPUT and port == 0) or (kind == "Select" and port in (1, 2)) \
                or _scaled_per_row(node, port):
            reached += _only_additive_mask(node.output(0), seen + 1)
        else:
            raise NoMatch(f"the bias reaches {describe_node(node)} input {port}, not only an attention mask")
    return reached


def _widened_bias(multiply: ov.Node) -> ov.Node:
    """The Convert to f32 or f64 that a bias computed in a reduced type (Falcon's bf16) reaches
    through single-use layout nodes: where it is exact again and can be shifted exactly."""
    value = multiply.output(0)
    for _ in range(_MAX_PATH):
        targets = list(value.get_target_inputs())
        if len(targets) != 1:
            raise NoMatch("the reduced-precision bias has several uses before it becomes f32")
        node = targets[0].get_node()
        kind = node.get_type_name()
        if kind == "Convert" and node.get_output_element_type(0) in _EXACT_POSITIONS:
            return node
        if kind not in ("Reshape", "Unsqueeze", "Squeeze") or targets[0].get_index() != 0:
            raise NoMatch(f"the reduced-precision bias reaches {describe_node(node)} before it becomes f32")
        value = node.output(0)
    raise NoMatch("the reduced-precision bias does not become f32 within a few layout nodes")


def _match(multiply: ov.Node):
    values = multiply.input_values()
    converts = [v for v in values if v.get_node().get_type_name() == "Convert"]
    slopes = [v for v in values if v.get_node().get_type_name() == "Constant"]
    if len(converts) != 1 or len(slopes) != 1 or not slopes[0].get_element_type().is_real():
        raise NoMatch("not a constant times a converted tensor")
    convert = converts[0].get_node()
    positions = convert.input_value(0)
    if not positions.get_element_type().is_integral() or not convert.get_output_element_type(0).is_real():
        raise NoMatch("not integers converted to floating point")
    if not _positions_from_cumsum(positions):
        raise NoMatch("the integers are not positions from a CumSum over the mask's last axis")
    if convert.get_output_element_type(0) not in _EXACT_POSITIONS:  # Falcon: shift the bias once it is f32
        widened = _widened_bias(multiply)
        if not _only_additive_mask(widened.output(0)):
            raise NoMatch("the bias reaches no attention")
        return widened, None
    if not _only_additive_mask(multiply.output(0)):
        raise NoMatch("the product reaches no attention")
    return convert, positions


def _relative(found) -> None:
    convert, positions = found
    if positions is None:
        _shift_bias(convert)
        return
    name = convert.get_friendly_name()
    newest = ops.reduce_max(positions, ops.constant(np.array([-1], np.int64)), keep_dims=True)
    shifted = ops.subtract(positions, newest)
    newest.set_friendly_name(f"{name}/relative_alibi_newest")
    shifted.set_friendly_name(f"{name}/relative_alibi")
    convert.input(0).replace_source_output(shifted.output(0))
    log.debug("relative-alibi: %s", describe_node(convert))


def _shift_bias(widened: ov.Node) -> None:
    """The bias, exact in f32 at `widened`, less its largest key's: a bf16 value minus another is
    exact in f32 over the range of an ALiBi bias (both multiples of the smaller's unit, within
    f32's 24 bits of each other)."""
    bias = widened.output(0)
    users = list(bias.get_target_inputs())
    name = widened.get_friendly_name()
    newest = ops.reduce_max(bias, ops.constant(np.array([-1], np.int64)), keep_dims=True)
    shifted = ops.subtract(bias, newest)
    newest.set_friendly_name(f"{name}/relative_alibi_newest")
    shifted.set_friendly_name(f"{name}/relative_alibi")
    for target in users:
        target.replace_source_output(shifted.output(0))
    log.debug("relative-alibi: %s (the bias once f32)", describe_node(widened))


ALIBI = Rule("relative-alibi/cumsum-positions", anchors=("Multiply",), match=_match, rewrite=_relative,
             where=lambda n: any(v.get_node().get_type_name() == "Convert" for v in n.input_values()))


@register_pass
@dataclass(frozen=True)
class RelativeAlibi(Pass):
    """ALiBi positions from cumsum(attention_mask) shifted so the newest token is 0 (exact: Softmax is per row)."""

    name: ClassVar[str] = "relative-alibi"

    def run(self, model: ov.Model) -> PassResult:
        hits = ALIBI.apply(model.get_ordered_ops())
        if hits:
            model.validate_nodes_and_infer_types()
        return PassResult(model, hits > 0)
