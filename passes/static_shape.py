"""static-shape: fix every dimension of a lifted model to one of the NPU's shapes (REFERENCE.md §4).

    kind=prefill  (prompt P)           input_ids/position_ids [1, P]   mask [1, P]   past 0
    kind=prefill  (prompt P, chunk C)  input_ids/position_ids [1, C]   mask [1, P]   past P - C
    kind=generate (size T, tokens G)   input_ids/position_ids [1, G]   mask [1, T]   past T - G

Batch is 1. Only inputs the model has are reshaped, so ALiBi models without position_ids work.
The pass takes lengths as given; aligning them the way NPUW does is `plan_lengths`, whose
result kvc reports. A pre-flight check then refuses the model if any value is still dynamic,
naming the node, the port and the dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import openvino as ov

from kvc.errors import UsageError, openvino_reason
from kvc.ir.kv_discovery import kv_layout
from kvc.passes.base import Pass, PassResult, describe_node, option
from kvc.passes.registry import register_pass

NPUW_ALIGN = 64
DEFAULT_MAX_PROMPT_LEN = 1024
DEFAULT_MIN_RESPONSE_LEN = 128
PYRAMID_BASE = 1024

# Inputs with one row per token of this step.
TOKEN_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids")
BEAM_TABLE = "past_beam_table"


def _align_up(value: int, to: int) -> int:
    return -(-value // to) * to


@dataclass(frozen=True)
class LengthPlan:
    """Effective lengths of a static pipeline, with every change from what the user asked."""

    prompt: int  # P
    response: int  # R
    chunk: int  # C, 0 without chunked prefill
    sizes: tuple[int, ...]  # generate variants T1 < ... < Tn (Tn = P + R)
    tokens: int = 1  # G
    notes: tuple[str, ...] = field(default=())

    @property
    def capacity(self) -> int:
        return self.sizes[-1]

    def to_dict(self) -> dict:
        return {"max_prompt_len": self.prompt, "min_response_len": self.response, "prefill_chunk_size": self.chunk,
                "generate_sizes": list(self.sizes), "tokens_per_step": self.tokens, "capacity": self.capacity,
                "adjustments": list(self.notes)}


def plan_lengths(max_prompt_len: int = DEFAULT_MAX_PROMPT_LEN, min_response_len: int = DEFAULT_MIN_RESPONSE_LEN,
                 chunk: int = 0, variants: str | tuple[int, ...] = "single", align: int = NPUW_ALIGN) -> LengthPlan:
    """NPUW's length rules: P and R aligned up to 64 (`align`), the chunk a power of two and P
    aligned up to it; variants "single" (T = P + R), "pyramid" (1024 * 2^k + R up to T), or
    explicit sizes (each ≤ T, T added). Every adjustment is recorded in `notes`."""
    notes = []
    if max_prompt_len <= 0 or min_response_len <= 0:
        raise UsageError(f"max prompt length and min response length must be positive "
                         f"(got {max_prompt_len} and {min_response_len})")
    if chunk < 0 or (chunk and chunk & (chunk - 1)):
        raise UsageError(f"prefill chunk size must be a power of two, got {chunk}")
    p = _align_up(max_prompt_len, align) if align > 1 else max_prompt_len
    if p != max_prompt_len:
        notes.append(f"max prompt length {max_prompt_len} aligned up to {p} (multiple of {align})")
    if chunk:
        if chunk > p:
            raise UsageError(f"prefill chunk size {chunk} exceeds the max prompt length {p}")
        p2 = _align_up(p, chunk)
        if p2 != p:
            notes.append(f"max prompt length {p} aligned up to {p2} (multiple of the chunk size {chunk})")
        p = p2
    r = _align_up(min_response_len, align) if align > 1 else min_response_len
    if r != min_response_len:
        notes.append(f"min response length {min_response_len} aligned up to {r} (multiple of {align})")
    total = p + r
    if variants == "single":
        sizes = (total,)
    elif variants == "pyramid":
        sizes = tuple(sorted({PYRAMID_BASE * 2 ** k + r for k in range(32) if PYRAMID_BASE * 2 ** k + r < total}
                             | {total}))
    else:
        asked = tuple(sorted(set(int(v) for v in variants)))
        if not asked or asked[0] <= 1:
            raise UsageError(f"generate variant sizes must be > 1, got {list(asked)}")
        if asked[-1] > total:
            raise UsageError(f"generate variant {asked[-1]} exceeds the KV capacity P + R = {p} + {r} = {total}")
        sizes = tuple(sorted(set(asked) | {total}))
        if total not in asked:
            notes.append(f"generate variant {total} (= P + R) added: the largest variant must hold the capacity")
    return LengthPlan(p, r, chunk, sizes, 1, tuple(notes))


@register_pass
@dataclass(frozen=True)
class StaticShape(Pass):
    """Reshape a lifted model to a static prefill or generate shape (batch 1)."""

    name: ClassVar[str] = "static-shape"
    kind: str = option("generate", choices=("prefill", "generate"), help="which model of the static pipeline")
    prompt: int = option(DEFAULT_MAX_PROMPT_LEN, help="prefill: max prompt length P (mask length)")
    chunk: int = option(0, help="prefill: chunk size C (0: the whole prompt at once)")
    size: int = option(DEFAULT_MAX_PROMPT_LEN + DEFAULT_MIN_RESPONSE_LEN,
                       help="generate: variant size T (mask length; past is T - tokens)")
    tokens: int = option(1, help="generate: tokens per step G")

    def lengths(self) -> tuple[int, int, int]:
        """(tokens this step, mask length, past length)."""
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
        if model.get_variables():
            raise self.fail("the model is still stateful; run lift-state first")
        step, mask, past = self.lengths()
        layout = kv_layout(model)
        kv_inputs = {t.input_name: t for t in layout.tensors}
        shapes: dict[int, ov.PartialShape] = {}
        for i, port in enumerate(model.inputs):
            names = port.get_names()
            pshape = port.get_partial_shape()
            if names & set(TOKEN_INPUTS):
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
            shapes[i] = ov.PartialShape(new)
        _reshape(model, shapes, self)
        preflight(model, self.name)
        return PassResult(model, True)


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


def preflight(model: ov.Model, pass_name: str = "static-shape") -> None:
    """Refuse a model with any dynamic dimension, naming the first node, port and dimension."""
    from kvc.passes.base import PassFailure

    if not model.is_dynamic():  # OpenVINO's own check of every op's inputs: 1 ms, not 7
        return
    for node in model.get_ordered_ops():
        for port in range(node.get_output_size()):
            pshape = node.get_output_partial_shape(port)
            if pshape.is_static:
                continue
            if pshape.rank.is_dynamic:
                raise PassFailure(pass_name, f"output {port} has a dynamic rank", node)
            for axis, dim in enumerate(pshape):
                if dim.is_dynamic:
                    raise PassFailure(pass_name, f"output {port} is still dynamic in dimension {axis} "
                                                 f"(shape {pshape}); a static-shape device cannot run it", node)


__all__ = ["StaticShape", "LengthPlan", "plan_lengths", "preflight", "describe_node"]
