"""unmask-pad-rows: let every query attend to its own slot, so padding cannot poison valid rows.

The static prefill is left-padded: a pad slot is masked as a key for everyone, itself
included, so a pad *query* row is fully masked. With a boolean attention mask that row's
softmax is 0/0 = NaN (in OpenVINO CPU as in its spec); the NaN becomes the next layer's
keys and values of the pad slot, and `0 * NaN` in the valid rows' weighted sum turns every
valid row into NaN. transformers avoids it at run time ("unmask unattended" rows); a static
graph needs it in the graph.

On a static model, each ScaledDotProductAttention with a boolean mask gets
``mask OR self`` where ``self[i, S - L + i]`` is true (query i of this step sits in key slot
S - L + i). A valid query already attends to its own slot, so valid rows are unchanged; only
rows whose outputs nobody reads (pad rows) change. Float masks use a large finite negative
value in transformers' exports and never produce NaN, so they are left alone.
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


def _bool_mask_sdpa(node: ov.Node) -> ov.Node:
    if node.get_input_size() < 4:
        raise NoMatch("no attention mask input")
    if node.get_input_element_type(3) != ov.Type.boolean:
        raise NoMatch(f"the mask is {node.get_input_element_type(3).get_type_name()}, not boolean "
                      f"(a float mask never makes a NaN row)")
    return node


def _own_slot(sdpa: ov.Node) -> None:
    """mask OR self: query i of this step attends to its own slot S - L + i."""
    q, k = sdpa.get_input_partial_shape(0), sdpa.get_input_partial_shape(1)
    L, S = q[q.rank.get_length() - 2].get_length(), k[k.rank.get_length() - 2].get_length()
    own = np.zeros((L, S), bool)
    own[np.arange(L), np.arange(S - L, S)] = True
    mask = ops.logical_or(sdpa.input_value(3), ops.constant(own))
    mask.set_friendly_name(f"{sdpa.get_friendly_name()}/own_slot")
    sdpa.input(3).replace_source_output(mask.output(0))
    log.debug("unmask-pad-rows: %s", describe_node(sdpa))


OWN_SLOT = Rule("unmask-pad-rows/bool-mask", anchors=("ScaledDotProductAttention",), match=_bool_mask_sdpa,
                rewrite=_own_slot)


@register_pass
@dataclass(frozen=True)
class UnmaskPadRows(Pass):
    """Give fully masked (pad) query rows their own slot, avoiding NaN under left padding."""

    name: ClassVar[str] = "unmask-pad-rows"
    requires: ClassVar[tuple[str, ...]] = ("static",)

    def run(self, model: ov.Model) -> PassResult:
        rewritten = OWN_SLOT.apply(model.get_ordered_ops())
        if rewritten:
            model.validate_nodes_and_infer_types()
        return PassResult(model, rewritten > 0)
