"""unmask-pad-rows: let every query attend to its own slot, so padding cannot poison valid rows.

The static prefill is left-padded: a pad slot is masked as a key for everyone, itself
included, so a pad *query* row is fully masked. With a boolean attention mask that row's
softmax is 0/0 = NaN (in OpenVINO CPU as in its spec); the NaN becomes the next layer's
keys and values of the pad slot, and `0 * NaN` in the valid rows' weighted sum turns every
valid row into NaN. transformers avoids it at run time ("unmask unattended" rows); a static
graph needs it in the graph.

A float mask is no safer than its fill value. transformers fills with float32's lowest
finite value (-3.4028235e38), which stays finite only while the mask is computed in f32:
rounded to bfloat16 (round to nearest even) it becomes -inf, and the same holds in f16 unless
a conversion clamps. A model that fills with -inf itself (Bloom's eager path, many custom
models) never had a finite fill. Either way the pad row is all -inf, softmax is NaN, and the
NaN spreads as above: this was the NaN of Bloom's logits at step 0 on NPUW's CPU backend on a
bf16-capable host (issue 11), reproduced here by giving the Bloom fixture a -inf fill.

On a static model, each ScaledDotProductAttention's mask gets its pad rows' own slot back.
Query i of this step sits in key slot S - L + i; ``own[i, S - L + i]`` is true.

- bool-mask: ``mask OR own``.
- float-mask: ``Select(own, Maximum(mask, F16_LOWEST), mask)``: the own slot is raised to at
  least -65504, finite in f32, f16 and bf16, and every other entry is untouched.

- eager-softmax: attention written out (MatMul, Add of the mask, Softmax, MatMul: XGLM,
  GPT-NeoX-Japanese) has no mask input to edit; the Softmax over [.., L, S] scores (L this
  step's rows, S the mask's slots) reads ``Select(own, Maximum(x, F16_LOWEST), x)`` instead.

A valid query already attends to its own slot with a finite bias, so valid rows are unchanged
(bit for bit); only rows whose outputs nobody reads (pad rows) change. One ``own`` constant
is shared by every attention of a model with the same L and S.

- finite-fill: a fill of float32's lowest poisons valid rows too once rounded to bf16, where
  it is -inf: ``(1 - attention_mask) * lowest`` is ``0 * -inf = NaN`` at every attended slot.
  Gemma 3's mask (optimum's `_create_gemma4_unified_bidirectional_mask_dict`) computes its
  padding so; OpenVINO's CPU plugin kept that at f32 while the model's shapes were dynamic,
  and with static shapes computed it at bf16: the static prefill's logits were 0.85 of their
  spread off (the source model itself reshaped to [1, 128] by OpenVINO alone: 1.53 off at
  bf16, 0.019 dynamic). Every f32 constant of at most FILL_ELEMENTS that no MatMul, Gather or
  Convolution reads (not a weight) and that holds float32's lowest holds BF16_LOWEST there
  instead, finite in bf16 and f32 alike: a mask's fill (`full`, `masked_fill`, the padding's
  product), and a clamp such as XGLM's `Maximum(x, lowest)`. A masked score's exp() is 0
  either way, and no activation comes near either bound, so at f32 the model computes the
  same (bloom, mpt, xglm and gemma3: their f32 logits bit-identical with and without it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult, describe_node
from kvc.passes.framework.registry import register_pass
from kvc.passes.framework.rules import NoMatch, Rule

log = logging.getLogger(__name__)


F16_LOWEST = -65504.0  # the lowest finite f16; bf16 and f32 hold it too
BF16_LOWEST = float(np.float32(-3.3895313892515355e38))  # the lowest finite bf16 (0xFF7F), exact in f32
FILL_ELEMENTS = 1 << 22  # a fill is a scalar or a mask table ([P, S] at most)


def _masked_sdpa(node: ov.Node, *, boolean: bool) -> ov.Node:
    if node.get_input_size() < 4:
        raise NoMatch("no attention mask input")
    element = node.get_input_element_type(3)
    if (element == ov.Type.boolean) != boolean:
        raise NoMatch(f"the mask is {element.get_type_name()}, not {'boolean' if boolean else 'floating-point'}")
    return node


def _own_slot(sdpa: ov.Node, cache: dict) -> ov.Output:
    """The [L, S] boolean table of query i's own key slot S - L + i (shared per L, S)."""
    q, k = sdpa.get_input_partial_shape(0), sdpa.get_input_partial_shape(1)
    return _own_table(q[q.rank.get_length() - 2].get_length(), k[k.rank.get_length() - 2].get_length(), cache)


def _own_table(L: int, S: int, cache: dict) -> ov.Output:
    if (L, S) not in cache:
        own = np.zeros((L, S), bool)
        own[np.arange(L), np.arange(S - L, S)] = True
        const = ops.constant(own)
        const.set_friendly_name(f"unmask-pad-rows/own_slot_{L}x{S}")
        cache[L, S] = const.output(0)
    return cache[L, S]


def _unmask_bool(sdpa: ov.Node, cache: dict) -> None:
    """mask OR own: query i of this step attends to its own slot."""
    mask = ops.logical_or(sdpa.input_value(3), _own_slot(sdpa, cache))
    mask.set_friendly_name(f"{sdpa.get_friendly_name()}/own_slot")
    sdpa.input(3).replace_source_output(mask.output(0))
    log.debug("unmask-pad-rows: %s", describe_node(sdpa))


def _raise_own(node: ov.Node, port: int, own: ov.Output) -> None:
    """Input `port` of `node` reads Select(own, max(x, F16_LOWEST), x): the own slot is finite
    in every precision."""
    x = node.input_value(port)
    floor = ops.constant(np.array(F16_LOWEST, x.get_element_type().to_dtype()))
    unmasked = ops.select(own, ops.maximum(x, floor), x)
    unmasked.set_friendly_name(f"{node.get_friendly_name()}/own_slot")
    node.input(port).replace_source_output(unmasked.output(0))
    log.debug("unmask-pad-rows: %s", describe_node(node))


def _unmask_float(sdpa: ov.Node, cache: dict) -> None:
    _raise_own(sdpa, 3, _own_slot(sdpa, cache))


def _eager_softmax(node: ov.Node, steps: int, slots: int) -> ov.Node:
    """A last-axis Softmax over floating [.., steps, slots] scores: written-out attention."""
    shape = node.get_input_partial_shape(0)
    if not node.get_input_element_type(0).is_real() or shape.rank.is_dynamic or shape.rank.get_length() < 3:
        raise NoMatch("its input is not floating-point scores of rank 3 or more")
    r = shape.rank.get_length()
    if node.get_attributes().get("axis") not in (-1, r - 1):
        raise NoMatch("it is not over the last axis")
    if not (shape[r - 2].is_static and shape[r - 1].is_static) or \
            (shape[r - 2].get_length(), shape[r - 1].get_length()) != (steps, slots):
        raise NoMatch(f"its scores are {shape}, not [.., {steps}, {slots}] (this step's rows, the mask's slots)")
    return node


WEIGHT_READERS = {"MatMul", "Gather", "Convolution"}  # a constant they read is a weight: never scanned


def _lowest_fill(node: ov.Node) -> bool:
    """A small f32 Constant, not a weight, that holds float32's lowest somewhere (a mask's fill)."""
    return (node.get_output_element_type(0) == ov.Type.f32
            and int(np.prod(node.get_output_shape(0))) <= FILL_ELEMENTS
            and not any(t.get_node().get_type_name() in WEIGHT_READERS for t in node.output(0).get_target_inputs())
            and bool((node.get_data() == np.finfo(np.float32).min).any()))


def _finite_fill(node: ov.Node) -> None:
    data = node.get_data()
    finite = ops.constant(np.where(data == np.finfo(np.float32).min, np.float32(BF16_LOWEST), data).astype(np.float32))
    finite.set_friendly_name(f"{node.get_friendly_name()}/finite_fill")
    node.output(0).replace(finite.output(0))
    log.debug("unmask-pad-rows: %s", describe_node(node))


def _rules(cache: dict, steps: int | None, slots: int | None) -> tuple[Rule, ...]:
    """bool-mask, float-mask, eager-softmax (with this step's rows and the mask's slots),
    finite-fill."""
    rules = (Rule("unmask-pad-rows/bool-mask", anchors=("ScaledDotProductAttention",),
                  match=partial(_masked_sdpa, boolean=True), rewrite=partial(_unmask_bool, cache=cache)),
             Rule("unmask-pad-rows/float-mask", anchors=("ScaledDotProductAttention",),
                  match=partial(_masked_sdpa, boolean=False), rewrite=partial(_unmask_float, cache=cache)))
    if steps is not None:
        rules += (Rule("unmask-pad-rows/eager-softmax", anchors=("Softmax",),
                       match=lambda n: _eager_softmax(n, steps, slots),
                       rewrite=lambda n: _raise_own(n, 0, _own_table(steps, slots, cache))),)
    return rules + (Rule("unmask-pad-rows/finite-fill", anchors=("Constant",), where=_lowest_fill,
                         match=lambda node: node, rewrite=_finite_fill),)


@register_pass
@dataclass(frozen=True)
class UnmaskPadRows(Pass):
    """Give fully masked (pad) query rows their own slot, avoiding NaN under left padding."""

    name: ClassVar[str] = "unmask-pad-rows"
    requires: ClassVar[tuple[str, ...]] = ("static",)

    def run(self, model: ov.Model) -> PassResult:
        ports = {p.get_any_name(): p for p in model.inputs}
        token = ports.get("input_ids") or ports.get("inputs_embeds")
        steps = slots = None
        if token is not None and "attention_mask" in ports and token.get_partial_shape().is_static:
            steps, slots = token.get_shape()[1], ports["attention_mask"].get_shape()[-1]
        ops_ = model.get_ordered_ops()
        rewritten = sum(rule.apply(ops_) for rule in _rules({}, steps, slots))
        if rewritten:
            model.validate_nodes_and_infer_types()
        return PassResult(model, rewritten > 0)
