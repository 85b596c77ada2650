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

from kvc.passes.base import Pass, PassResult, describe_node
from kvc.passes.registry import register_pass

log = logging.getLogger(__name__)


@register_pass
@dataclass(frozen=True)
class UnmaskPadRows(Pass):
    """Give fully masked (pad) query rows their own slot, avoiding NaN under left padding."""

    name: ClassVar[str] = "unmask-pad-rows"

    def run(self, model: ov.Model) -> PassResult:
        changed = False
        for node in model.get_ordered_ops():
            if node.get_type_name() != "ScaledDotProductAttention" or node.get_input_size() < 4:
                continue
            if node.get_input_element_type(3) != ov.Type.boolean:
                continue
            q, k = node.get_input_partial_shape(0), node.get_input_partial_shape(1)
            if not (q.is_static and k.is_static):
                raise self.fail("run static-shape first: attention shapes are still dynamic", node)
            L, S = q[q.rank.get_length() - 2].get_length(), k[k.rank.get_length() - 2].get_length()
            own = np.zeros((L, S), bool)
            own[np.arange(L), np.arange(S - L, S)] = True
            mask = ops.logical_or(node.input_value(3), ops.constant(own))
            mask.set_friendly_name(f"{node.get_friendly_name()}/own_slot")
            node.input(3).replace_source_output(mask.output(0))
            log.debug("unmask-pad-rows: %s", describe_node(node))
            changed = True
        if changed:
            model.validate_nodes_and_infer_types()
        return PassResult(model, changed)
