"""mlp-rows: a gated MLP's three MatMuls over 2-D rows, so the CPU plugin keeps them apart.

A gated MLP (Llama, Qwen, Mistral, Gemma, ...) is written over [B, L, H] activations:

    y = matmul(act(matmul(x, Wg^T)) * matmul(x, Wu^T), Wd^T)          # act: Swish or Gelu

OpenVINO 2026.4's CPU plugin, on an AMX host computing at bf16 (or AMX-FP16 at f16), fuses
that pattern into one LLMMLP node (intel_cpu mlp_fusion.cpp, registered in
transformation_pipeline.cpp's PostLpt "only enabled on AMX-bf16 & LLM serving"). LLMMLP takes
its weights at f16 (llm_mlp.cpp: `weightPrecision = f16`): an f32 model's weights are first
converted by a constant Reorder, whose f16 copy the compiled model keeps, then packed again
into LLMMLP's own layout. Measured on the 250M bench Llama (f32 weights, 16 layers, hidden
1024, intermediate 2816): each compiled static model held 710 MB with LLMMLP and 449 MB
without (-261 MB, the 138 M MLP weights at 2 bytes), and a prefill chunk ran no slower
without it (bench/compile_ab.py, docs/benchmarks.md).

This pass writes the pattern over rows: x is reshaped to [B*L, H] before the gate and up
MatMuls and the down MatMul's result back to [B, L, H'], which LLMMLP's pattern (its input is
rank 3) does not match, so the plugin builds three FullyConnected nodes that share nothing
but their input. Each product is the same dot products in the same order per row, so the
arithmetic is unchanged; only the plugin's choice of kernel moves. It matches exactly the
fused pattern: both projections read the same rank-3 value, with 2-D weights (transpose_a
false), the product's only consumer is the down MatMul. `kvc compile` runs it on the prefill
models of CPU-only compiles at bf16 (`--prefill-mlp auto`); the generate models keep LLMMLP
(a decode step measured slower without it: 36.0-44.1 against 33.5-41.6 ms, and 1.17x in an
A/B that gave the 16-row prefill model LLMMLP instead, docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult, describe_node, reinfer
from kvc.passes.framework.registry import register_pass
from kvc.passes.framework.rules import NoMatch, Rule

log = logging.getLogger(__name__)

ACTIVATIONS = ("Swish", "Gelu")  # what LLMMLP fuses (mlp_fusion.cpp: mlp_silu_gate, mlp_gelu_gate)


def _projection(value: ov.Output) -> ov.Node:
    node = value.get_node()
    if node.get_type_name() != "MatMul":
        raise NoMatch(f"{describe_node(node)} is not a MatMul")
    if node.get_attributes()["transpose_a"] or node.get_input_partial_shape(1).rank.get_length() != 2:
        raise NoMatch(f"{describe_node(node)} is not activations times a 2-D weight")
    return node


def _gated_mlp(product: ov.Node):
    if product.get_input_size() != 2:
        raise NoMatch("not a binary Multiply")
    for gated, other in ((0, 1), (1, 0)):
        act = product.input_value(gated).get_node()
        if act.get_type_name() in ACTIVATIONS:
            break
    else:
        raise NoMatch(f"neither input is one of {', '.join(ACTIVATIONS)}")
    gate, up = _projection(act.input_value(0)), _projection(product.input_value(other))
    x = gate.input_value(0)
    if up.input_value(0).get_node() is not x.get_node() or up.input_value(0).get_index() != x.get_index():
        raise NoMatch("the gate and up projections read different values")
    shape = x.get_partial_shape()
    if shape.rank.is_dynamic or shape.rank.get_length() != 3 or shape.is_dynamic:
        raise NoMatch(f"the MLP's input is {shape}, not a static [B, L, H]")
    users = list(product.output(0).get_target_inputs())
    if len(users) != 1 or users[0].get_index() != 0:
        raise NoMatch("the product has other consumers than the down projection")
    down = _projection(users[0].get_node().output(0))
    if len(act.output(0).get_target_inputs()) != 1 or len(gate.output(0).get_target_inputs()) != 1 \
            or len(up.output(0).get_target_inputs()) != 1:
        raise NoMatch("an intermediate value has other consumers")
    return x, gate, up, down


def _over_rows(found) -> None:
    x, gate, up, down = found
    shape = [d.get_length() for d in x.get_partial_shape()]
    name = down.get_friendly_name()
    rows = ops.reshape(x, ops.constant(np.array([-1, shape[-1]], np.int64)), False)
    rows.set_friendly_name(f"{name}/rows")
    for projection in (gate, up):
        projection.input(0).replace_source_output(rows.output(0))
    users = list(down.output(0).get_target_inputs())
    out_shape = [*shape[:-1], down.get_output_partial_shape(0)[-1].get_length()]
    back = ops.reshape(down.output(0), ops.constant(np.array(out_shape, np.int64)), False)
    back.set_friendly_name(f"{name}/unrows")
    for target in users:
        target.replace_source_output(back.output(0))
    reinfer([gate, up])
    log.debug("mlp-rows: %s", describe_node(down))


GATED_MLP = Rule("mlp-rows/gated-mlp", anchors=("Multiply",), match=_gated_mlp, rewrite=_over_rows)


@register_pass
@dataclass(frozen=True)
class MlpRows(Pass):
    """Gated MLPs (act(x Wg) * x Wu) Wd over 2-D rows [B*L, H], which the CPU plugin does not fuse into LLMMLP."""

    name: ClassVar[str] = "mlp-rows"

    def run(self, model: ov.Model) -> PassResult:
        hits = GATED_MLP.apply(model.get_ordered_ops())
        return PassResult(model, hits > 0)
