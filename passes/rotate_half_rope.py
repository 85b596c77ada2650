"""rotate-half-rope: split-halves rotary as the rotate-half form, bit for bit.

GPT-OSS's export computes rotary as

    x1, x2 = split(x, 2, axis=-1)
    out = concat(x1 * cos - x2 * sin, x2 * cos + x1 * sin, axis=-1)      # cos, sin: [.., D/2]

OpenVINO 2026.4.1's CPU plugin fuses this into a RoPE node that computes differently once a
compiled model is exported and imported again (same inputs, different outputs, up to 3.0 in
the logits; the optimum model alone gives NaN after export/import), so kvc's blob check
refuses GPT-OSS's CPU and NPU blobs. The rotate-half form that Llama exports use,

    out = x * concat(cos, cos) + concat(-x2, x1) * concat(sin, sin)

is the same arithmetic element by element (``a - b`` and ``a + (-b)`` are the same IEEE
operation, and a product of concatenations is the concatenation of the products), so the
rewrite changes no bit, and the CPU plugin's other RoPE fusion, which survives export, takes
it. The rule matches only that exact dataflow: both halves from one split of x into outputs
0 and 1, the same cos and sin on both sides, concatenated on the last axis.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import openvino as ov
import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult, describe_node
from kvc.passes.framework.registry import register_pass
from kvc.passes.framework.rules import NoMatch, Rule

log = logging.getLogger(__name__)


def _product(value: ov.Output) -> tuple[ov.Output, ov.Output]:
    node = value.get_node()
    if node.get_type_name() != "Multiply":
        raise NoMatch(f"{describe_node(node)} is not a Multiply")
    return node.input_value(0), node.input_value(1)


def _same(a: ov.Output, b: ov.Output) -> bool:
    return a.get_node() is b.get_node() or (a.get_node().get_friendly_name() == b.get_node().get_friendly_name()
                                            and a.get_index() == b.get_index())


def _split_halves(concat: ov.Node):
    if concat.get_input_size() != 2:
        raise NoMatch("not a Concat of two inputs")
    rank = concat.get_output_partial_shape(0).rank
    axis = int(concat.get_attributes()["axis"])
    if rank.is_dynamic or axis not in (-1, rank.get_length() - 1):
        raise NoMatch("not concatenated on the last axis")
    first, second = (v.get_node() for v in concat.input_values())
    if first.get_type_name() != "Subtract" or second.get_type_name() != "Add":
        raise NoMatch(f"inputs are {first.get_type_name()} and {second.get_type_name()}, not Subtract and Add")
    x1, cos = _product(first.input_value(0))
    x2, sin = _product(first.input_value(1))
    split = x1.get_node()
    if split.get_type_name() not in ("Split", "VariadicSplit") or not _same(x2, split.output(1)) \
            or x1.get_index() != 0:
        raise NoMatch("the first half is not x1 * cos - x2 * sin over outputs 0 and 1 of one split")
    b1, b2 = _product(second.input_value(0)), _product(second.input_value(1))
    if not (_same(b1[0], x2) and _same(b1[1], cos) and _same(b2[0], x1) and _same(b2[1], sin)):
        raise NoMatch("the second half is not x2 * cos + x1 * sin")
    return concat, split.input_value(0), x1, x2, cos, sin


def _rotate_half(found) -> None:
    concat, x, x1, x2, cos, sin = found
    name = concat.get_friendly_name()
    cos_full, sin_full = ops.concat([cos, cos], -1), ops.concat([sin, sin], -1)
    rotated = ops.concat([ops.negative(x2), x1], -1)
    out = ops.add(ops.multiply(x, cos_full), ops.multiply(rotated, sin_full))
    for node, suffix in ((cos_full, "cos_full"), (sin_full, "sin_full"), (rotated, "rotate_half"),
                         (out, "rotate_half_rope")):
        node.set_friendly_name(f"{name}/{suffix}")
    for target in list(concat.output(0).get_target_inputs()):
        target.replace_source_output(out.output(0))
    out.output(0).add_names(concat.output(0).get_names())
    log.debug("rotate-half-rope: %s", describe_node(concat))


SPLIT_HALVES = Rule("rotate-half-rope/split-halves", anchors=("Concat",), match=_split_halves, rewrite=_rotate_half)


@register_pass
@dataclass(frozen=True)
class RotateHalfRope(Pass):
    """Split-halves rotary (x1*cos - x2*sin, x2*cos + x1*sin) as rotate-half over full-width cos/sin."""

    name: ClassVar[str] = "rotate-half-rope"

    def run(self, model: ov.Model) -> PassResult:
        hits = SPLIT_HALVES.apply(model.get_ordered_ops())
        if hits:
            model.validate_nodes_and_infer_types()
        return PassResult(model, hits > 0)
