"""Probes: evaluate any intermediate model of the pipeline on the same logical input.

The pipeline changes a model's interface as it goes (state becomes inputs, shapes become
static, empty pasts disappear, KV turns f16 or transposed), so comparing intermediates needs
one driver per form:

* dynamic models (stateful, or stateless with past/present): a few greedy steps from a fixed
  prompt (`kvc.runtime.generate.greedy`);
* static models: one step of the NPU contract. The reference (the lifted source model) first
  runs `k` tokens to produce a cache; that cache is placed left-aligned into the model's past
  inputs (cast and transposed to whatever layout they now have), and the model runs this
  step's `n` tokens, left-padded in its `L` slots. The logits of the valid positions are
  compared with the reference's logits for the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

from kvc.ir.kv_discovery import kv_layout
from kvc.ir.text_embeddings import TOKEN_EMBEDS
from kvc.runtime.embeddings import embedder_of
from kvc.runtime.generate import first_step_feed, greedy, present_name
from kvc.runtime.ops.registry import to_dtype
from kvc.passes.kv_io import scale_name
from kvc.passes.prompt_end import PROMPT_LAST_POSITION
from kvc.runtime.session import NumpySession


@dataclass
class StaticFeed:
    inputs: dict[str, np.ndarray]
    rows: slice  # logits rows of the valid positions (model output)
    ref_logits: np.ndarray  # [n, V] reference logits for those positions
    f16: bool
    positions: int  # how many positions the step runs (its valid input rows)
    ref_rows: dict[str, np.ndarray] | None = None  # present name -> [1, H, n, D]: the rows this step writes


def is_static(model: ov.Model) -> bool:
    return all(p.get_partial_shape().is_static for p in model.inputs)


def dynamic_logits(model: ov.Model, prompt, steps: int) -> np.ndarray:
    """[steps, V] greedy logits of a dynamic model on kvc's numpy runtime."""
    return np.stack(greedy(NumpySession(model), prompt, steps).logits)


def _ports(model: ov.Model) -> dict[str, ov.Output]:
    return {name: p for p in model.inputs for name in p.get_names()}


def static_feed(model: ov.Model, reference: ov.Model, tokens: np.ndarray, case: tuple[int, int] | None = None,
                rows: int | None = None, memo: dict | None = None) -> StaticFeed:
    """Inputs for one static step of `model` and the reference logits to compare with.

    `reference` is a dynamic stateless model (the lifted source); `tokens` supplies the ids.
    `case` is (k, n): k tokens already in the cache, n run in this call, left-padded in its L
    rows (default: the first of `static_cases`). A model whose rows are dynamic (a first chunk
    of 1 to F rows, no past) runs `rows` rows (n, unpadded). `memo` keeps the reference's
    runs by (k, n) across calls with the same `reference` and `tokens`.
    """
    ports = _ports(model)
    embed = embedder_of(model)
    ids = ports["input_ids" if embed is None else TOKEN_EMBEDS].get_partial_shape()[1]
    k, n = case if case is not None else static_cases(model, rows)[0]
    L = ids.get_length() if ids.is_static else n  # dynamic rows: the call's own, unpadded
    mask = ports["attention_mask"].get_partial_shape()[-1] if "attention_mask" in ports else None
    M = mask.get_length() if mask is not None and mask.is_static else L
    past_slots = M - L
    if not (0 <= k <= past_slots and 1 <= n <= L):
        raise ValueError(f"a step of {n} tokens over {k} cached does not fit {L} rows over {past_slots} past slots")
    seq = np.asarray(tokens[: k + n], np.int64)
    memo = {} if memo is None else memo
    if (k, n) not in memo:
        ref = NumpySession(reference)
        pasts = {name for name in ref.input_names if name.startswith("past_key_values")}
        # The past is the whole run's first k rows, not a run of k tokens: LongRoPE rotates
        # every row of a call at the factors of its longest position (`kvc.passes.prompt_end`).
        full = ref.infer(first_step_feed(ref, seq))
        axes = {t.input_name: t.seq_axis for t in kv_layout(reference).tensors}
        cache = {name: np.take(full[present_name(name)], np.arange(k), axis=axes[name]) for name in pasts} if k else {}
        written = {present_name(name): full[present_name(name)][:, :, k:k + n] for name in pasts}
        memo[k, n] = pasts, cache, full["logits"][0, k:k + n], written
    pasts, cache, ref_logits, written = memo[k, n]
    feed: dict[str, np.ndarray] = {}
    ids = np.zeros((1, L), np.int64)
    ids[0, L - n:] = seq[k:]
    mask = np.zeros((1, M), np.int64)
    mask[0, :k] = 1
    mask[0, M - n:] = 1
    pos = np.zeros((1, L), np.int64)
    pos[0, L - n:] = np.arange(k, k + n)
    candidates = {"input_ids": ids, TOKEN_EMBEDS: None if embed is None else embed(ids),
                  "token_type_ids": np.zeros_like(ids), "attention_mask": mask, "position_ids": pos,
                  "beam_idx": np.zeros(1, np.int32),
                  PROMPT_LAST_POSITION: np.array(k + n - 1, np.int64)}  # the reference runs seq whole
    f16 = False
    for name, port in ports.items():
        if name in candidates:
            feed[name] = candidates[name]
        elif name.startswith("past_key_values") and name in pasts and port.get_element_type() == ov.Type.i8:
            feed[name], feed[scale_name(name)] = _place_int8(cache.get(name), port, ports[scale_name(name)])
        elif name.startswith("past_key_values") and name in pasts:
            feed[name], is_f16 = _place(cache.get(name), port)
            f16 |= is_f16
    # an int8 cache's f16 scales are no f16 cache: its session is widened and exact (`session_for`)
    f16 |= any(o.get_element_type() == ov.Type.f16 and not any(m.endswith("_scale") for m in o.get_names())
               for o in model.outputs)
    logits_rows = next(o.get_partial_shape()[1] for o in model.outputs if "logits" in o.get_names())
    logits_len = logits_rows.get_length() if logits_rows.is_static else L
    rows = slice(logits_len - n, logits_len) if logits_len == L else slice(logits_len - 1, logits_len)
    if logits_len != L:
        ref_logits = ref_logits[-1:]
    return StaticFeed(feed, rows, ref_logits, f16, n, written)


def written_rows(model: ov.Model, outputs: dict, n: int) -> dict[str, np.ndarray]:
    """The rows a static step of `n` tokens wrote, by present name, as [1, H, n, D] f32: the
    last `n` slots of each present output (its new rows only, or its whole cache, the new ones
    last), read back from a values-last layout (kv-io's transpose_v, `_values_last`). An int8
    cache's presents and scales are left out (read through dequantization)."""
    found = {}
    for result in model.get_results():
        names = result.output(0).get_names()
        name = next((m for m in names if m.startswith("present.") and m in outputs), None)
        if name is None or name.endswith("_scale") or result.get_output_element_type(0) == ov.Type.i8:
            continue
        producer = result.input_value(0).get_node()
        if producer.get_type_name() == "Convert":
            producer = producer.input_value(0).get_node()
        value = np.asarray(outputs[name], np.float32)
        found[name] = np.swapaxes(value[..., -n:], 2, 3) if _values_last(producer) else value[:, :, -n:, :]
    return found


def _values_last(node: ov.Node) -> bool:
    """kv-io's Transpose to a values-last layout ([B, H, D, S]: the last two axes swapped), not
    a model's own (its heads' [B, S, H, D] -> [B, H, S, D])."""
    if node.get_type_name() != "Transpose" or node.input_value(1).get_node().get_type_name() != "Constant":
        return False
    return list(node.input_value(1).get_node().get_data()) == [0, 1, 3, 2]


def dynamic_rows(model: ov.Model) -> bool:
    """Whether `model`'s only dynamic input dimension is its rows (a first chunk of dynamic rows):
    the token ids' axis 1 and the axis it shares with the mask, positions and token types."""
    ports = _ports(model)
    ids = ports.get("input_ids", ports.get(TOKEN_EMBEDS))
    if ids is None or ids.get_partial_shape().rank.is_dynamic or ids.get_partial_shape()[1].is_static:
        return False
    for port in model.inputs:
        shape = port.get_partial_shape()
        if shape.rank.is_dynamic or sum(not d.is_static for d in shape) > 1:
            return False
    return True


def static_cases(model: ov.Model, rows: int | None = None) -> list[tuple[int, int]]:
    """The (k, n) steps a static stage is judged on (`static_feed`): k tokens already cached,
    n in the call. The first is half the past filled and the call full (a prefill over no past:
    three rows of left padding); then the call over an empty past and over a full one (the last
    slots and the last positions a model has, where a position table or a mask one short
    fails), and a call of one token (a call mostly padding: a pad slot attended). `rows`: a
    model of dynamic rows runs calls of 1 to `rows` tokens, no padding: F - 3, F and 1."""
    ports = _ports(model)
    ids = ports["input_ids" if "input_ids" in ports else TOKEN_EMBEDS].get_partial_shape()[1]
    L = ids.get_length() if ids.is_static else rows
    mask = ports["attention_mask"].get_partial_shape()[-1] if "attention_mask" in ports else None
    past = (mask.get_length() if mask is not None and mask.is_static else L) - L
    if not past:
        return list(dict.fromkeys([(0, max(1, L - 3)), (0, L), (0, 1)]))
    return list(dict.fromkeys([(past // 2, L), (0, L), (past, L), (past // 2, 1), (past, 1)]))


def session_for(model: ov.Model) -> NumpySession:
    """A static stage's session: widened when it stores an int8 cache (its i8 inputs then take
    f32, read back through its own dequantization exactly, and its quantizers round nothing:
    `kvc.runtime.interpreter.Interpreter`), so the stage is judged exactly, as the compile
    judges its IR."""
    return NumpySession(model, widen=any(p.get_element_type() == ov.Type.i8 for p in model.inputs))


def _place_int8(rows: np.ndarray | None, port: ov.Output, scale: ov.Output) -> tuple[np.ndarray, np.ndarray]:
    """Rows [1, H, k, D] put left-aligned into an int8 past input and its scales, for a widened
    session (`session_for`): each row as it is over scale 1, divided by the key channels the
    dequantization multiplies by (kv-io), so that it reads back the very rows."""
    q = np.zeros(list(port.get_shape()), np.float32)
    ones = np.ones(list(scale.get_shape()), np.float32)
    if rows is not None and rows.shape[2] and 0 not in q.shape:
        q[:, :, :rows.shape[2], :] = rows / _key_channels(port)
    return q, ones


def _key_channels(port: ov.Output) -> np.ndarray | float:
    """The calibrated key channels an int8 past input's dequantization multiplies by (its
    Convert, the Multiply by its scales, then one by a constant), or 1."""
    for convert in port.get_target_inputs():
        for scaled in convert.get_node().output(0).get_target_inputs():
            for target in scaled.get_node().output(0).get_target_inputs():
                node = target.get_node()
                other = node.input_value(1 - target.get_index()).get_node() if node.get_input_size() == 2 else None
                if node.get_type_name() == "Multiply" and other is not None and other.get_type_name() == "Constant":
                    return np.asarray(other.get_data(), np.float32)
    return 1.0


def _place(rows: np.ndarray | None, port: ov.Output) -> tuple[np.ndarray, bool]:
    """Rows [1, H, k, D] put left-aligned into a past input of any layout and element type."""
    shape = list(port.get_shape())
    dtype = to_dtype(port.get_element_type())
    buf = np.zeros(shape, dtype)
    if rows is None or rows.shape[2] == 0 or 0 in shape:
        return buf, dtype == np.float16
    k = rows.shape[2]
    # kv-io stores values sequence-last and reads them back through a Transpose.
    transposed = any(t.get_node().get_type_name() == "Transpose" for t in port.get_target_inputs())
    if transposed:
        buf[:, :, :, :k] = np.swapaxes(rows, 2, 3).astype(dtype)
    else:
        buf[:, :, :k, :] = rows.astype(dtype)
    return buf, dtype == np.float16
