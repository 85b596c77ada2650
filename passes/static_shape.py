"""static-shape: fix every dimension of a lifted model to one of the NPU's shapes (REFERENCE.md §4).

    kind=prefill  (prompt P)           input_ids/position_ids [1, P]   mask [1, P]   past 0
    kind=prefill  (prompt P, chunk C)  input_ids/position_ids [1, C]   mask [1, P]   past P - C
    kind=generate (size T, tokens G)   input_ids/position_ids [1, G]   mask [1, T]   past T - G
    kind=prefill, rows=dynamic         input_ids/position_ids [1, ?]   mask [1, ?]   past 0

`rows=dynamic` (a prefill without a chunk: kvc's first chunk of dynamic rows, CPU-only
compiles) leaves the row dimension of the token inputs and the mask dynamic: the model takes
a prompt's first tokens unpadded, so its positions are its slots and it needs none of the
passes that make a padded static layout compute right (mask-positions, unmask-pad-rows).

Batch is 1. Only inputs the model has are reshaped, so ALiBi models without position_ids work.
A vision-language model's 3-D position_ids (mRoPE, Qwen2-VL: [3, B, S], a temporal, height and
width position per token) become [3, 1, rows].
The pass takes lengths as given; aligning them the way NPUW does is `kvc.plan.plan_lengths`,
whose result kvc reports. The pass ensures `static`: the PassManager then refuses the model if any
value is still dynamic, naming the node, the port and the dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import openvino as ov

from kvc.errors import openvino_reason
from kvc.ir.kv_discovery import kv_layout
from kvc.passes.framework.base import Pass, PassResult, option
from kvc.passes.framework.registry import register_pass
from kvc.plan import DEFAULT_MAX_PROMPT_LEN, DEFAULT_MIN_RESPONSE_LEN

# Inputs with one row per token of this step.
TOKEN_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids")
BEAM_TABLE = "past_beam_table"


@register_pass
@dataclass(frozen=True)
class StaticShape(Pass):
    """Reshape a lifted model to a static prefill or generate shape (batch 1)."""

    name: ClassVar[str] = "static-shape"
    requires: ClassVar[tuple[str, ...]] = ("stateless",)
    kind: str = option("generate", choices=("prefill", "generate"), help="which model of the static pipeline")
    prompt: int = option(DEFAULT_MAX_PROMPT_LEN, help="prefill: max prompt length P (mask length)")
    chunk: int = option(0, help="prefill: chunk size C (0: the whole prompt at once)")
    size: int = option(DEFAULT_MAX_PROMPT_LEN + DEFAULT_MIN_RESPONSE_LEN,
                       help="generate: variant size T (mask length; past is T - tokens)")
    tokens: int = option(1, help="generate: tokens per step G")
    rows: str = option("static", choices=("static", "dynamic"),
                       help="prefill without a chunk: the rows of the token inputs and mask static (P) or dynamic")

    @property
    def ensures(self) -> tuple[str, ...]:
        return ("static",) if self.rows == "static" else ("static-but-rows",)

    def lengths(self) -> tuple[int, int, int]:
        """(tokens this step, mask length, past length)."""
        if self.rows == "dynamic" and (self.kind != "prefill" or self.chunk):
            raise self.fail("rows=dynamic is for a prefill without a chunk (a first chunk): its past is empty")
        if self.kind == "prefill":
            if self.chunk:
                if self.prompt % self.chunk:
                    raise self.fail(f"prompt {self.prompt} is not a multiple of the chunk size {self.chunk}")
                return self.chunk, self.prompt, self.prompt - self.chunk
            return self.prompt, self.prompt, 0
        if not 0 < self.tokens < self.size:
            raise self.fail(f"tokens per step {self.tokens} must be in 1..{self.size - 1}")
        return self.tokens, self.size, self.size - self.tokens

    def run(self, model: ov.Model) -> PassResult:
        step, mask, past = self.lengths()
        if self.rows == "dynamic":
            step = mask = -1
        layout = kv_layout(model)
        kv_inputs = {t.input_name: t for t in layout.tensors}
        shapes: dict[int, ov.PartialShape] = {}
        for i, port in enumerate(model.inputs):
            names = port.get_names()
            pshape = port.get_partial_shape()
            if "position_ids" in names and pshape.rank.is_static and pshape.rank.get_length() == 3:
                if pshape[0].is_dynamic:  # mRoPE (Qwen2-VL): [sections, B, S]
                    raise self.fail(f"cannot tell the sections of 3-D position_ids {pshape} (expected [3, ?, ?])")
                new = [pshape[0].get_length(), 1, step]
            elif names & set(TOKEN_INPUTS):
                new = [1, step] + [d.get_length() for d in list(pshape)[2:]]
            elif "attention_mask" in names:
                new = [1, mask]
            elif "beam_idx" in names:
                new = [1]
            elif BEAM_TABLE in names:
                new = [1, past]
            elif names & set(kv_inputs):
                t = kv_inputs[next(iter(names & set(kv_inputs)))]
                new = [d.get_length() if d.is_static else -1 for d in pshape]
                new[t.batch_axis], new[t.seq_axis] = 1, past
                if -1 in new:
                    raise self.fail(f"cannot tell all dimensions of KV input {port.get_any_name()} {pshape}")
            elif pshape.is_static:
                continue
            else:
                raise self.fail(f"no static shape is known for input {port.get_any_name()} {pshape}",
                                port.get_node())
            if ov.PartialShape(new) != pshape:
                shapes[i] = ov.PartialShape(new)
        if shapes:
            _reshape(model, shapes, self)
        return PassResult(model, bool(shapes))


def _reshape(model: ov.Model, shapes: dict[int, ov.PartialShape], owner: StaticShape) -> None:
    """Set the input shapes and infer the rest. Shape inference alone is 5x cheaper than
    `Model.reshape`, which first runs OpenVINO's SmartReshape rewrites over the whole graph;
    those only matter to a model whose shape constants do not follow its inputs, so
    `Model.reshape` is the fallback when inference alone fails."""
    inputs = model.inputs  # a new list of ports at every access
    before = {i: inputs[i].get_partial_shape() for i in shapes}
    for i, shape in shapes.items():
        inputs[i].get_node().set_partial_shape(shape)
    try:
        model.validate_nodes_and_infer_types()
        return
    except RuntimeError:
        pass
    try:  # undo first: Model.reshape skips inputs that already match, and its rewrites look
        for i, shape in before.items():  # at the shapes that inference left behind
            inputs[i].get_node().set_partial_shape(shape)
        model.validate_nodes_and_infer_types()
        model.reshape({inputs[i]: s for i, s in shapes.items()})
    except RuntimeError as exc:
        raise owner.fail(f"OpenVINO cannot reshape the model: {openvino_reason(exc)}") from None


__all__ = ["StaticShape"]
