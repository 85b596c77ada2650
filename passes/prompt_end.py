"""prompt-end: a prefill model reads its call's largest position from the prompt, not its rows.

optimum's Phi-3 patch (Phi-3-mini-128k, Phi-3.5, Phi-4-mini: LongRoPE) takes a call's rotary
factors by its largest position: `max(position_ids) + 1 > original_max_position_embeddings`
picks the long factors, else the short ones (a ReduceMax over every axis of `position_ids`,
then a Select, in the IR). The source runs a prompt in one call, so every row of a prompt
that reaches T rotates at the long factors. A static prefill in chunks (or a first chunk, or
a call after restored rows) sees only its own rows' positions: its chunks below T rotated at
the short ones, and its cache and logits were not the source's.

The rule, in every prefill model (`static-shape{kind=prefill}`): each ReduceMax over all of
`position_ids` becomes the input `prompt_last_position` ([], the type of `position_ids`),
which the runtime feeds the prompt's last position (`StaticPipeline._prefill`: the largest
position of the source's one call; a caller running one call feeds its own largest,
`StaticPipeline.step_feed`). Where every row of a call is the prompt's (an unchunked prefill:
its pad rows' positions are 0) the two agree, so the rule changes nothing there. The
generate models keep theirs: a step's position is its call's, in the source as here.

A ReduceMax over only some axes of the positions (a per-row maximum) is not a call's maximum
and is left alone, as is every model without one (the pass is a no-op).
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

log = logging.getLogger(__name__)

PROMPT_LAST_POSITION = "prompt_last_position"


def _over_every_axis(reduce: ov.Node, rank: int) -> bool:
    axes = reduce.input_value(1).get_node()
    if axes.get_type_name() != "Constant":
        return False
    return sorted(int(a) % rank for a in np.asarray(axes.get_data()).ravel()) == list(range(rank))


@register_pass
@dataclass(frozen=True)
class PromptEnd(Pass):
    """Each ReduceMax over all of position_ids reads the input prompt_last_position instead (prefill models)."""

    name: ClassVar[str] = "prompt-end"
    ensures: ClassVar[tuple[str, ...]] = ()

    def run(self, model: ov.Model) -> PassResult:
        positions = next((p for p in model.get_parameters() if p.output(0).get_names() & {"position_ids"}), None)
        if positions is None or positions.get_partial_shape().rank.is_dynamic:
            return PassResult(model, False)
        rank = positions.get_partial_shape().rank.get_length()
        found = [t.get_node() for t in positions.output(0).get_target_inputs()
                 if t.get_node().get_type_name() == "ReduceMax" and _over_every_axis(t.get_node(), rank)]
        if not found:
            return PassResult(model, False)
        last = ops.parameter([], positions.get_element_type(), name=PROMPT_LAST_POSITION)
        last.output(0).set_names({PROMPT_LAST_POSITION})
        for reduce in found:
            value = last.output(0)
            shape = reduce.get_output_partial_shape(0)
            if shape.rank.get_length():  # keep_dims: [1, 1]
                value = ops.reshape(value, ops.constant(np.asarray(shape.to_shape(), np.int64)), False).output(0)
            for target in list(reduce.output(0).get_target_inputs()):
                target.replace_source_output(value)
            log.debug("prompt-end: %s reads %s", describe_node(reduce), PROMPT_LAST_POSITION)
        model.add_parameters([last])
        model.validate_nodes_and_infer_types()
        return PassResult(model, True)
