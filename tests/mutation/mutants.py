"""Faults put into kvc's static models, to show that its proof refuses them (the mutation
campaign of 2026-11-27, docs/verification.md).

A *mutant* edits a static model's graph in place just before it is written into the output
directory (`Bundle.add`: the IR and the blobs compiled from it are both wrong, the source model
is not), or, with `where="blob"`, only the model the device compile reads (its IR and kvc's
numpy check stay right, the blobs do not). Some also patch a pass or a phase (`hooks`). Each
is what a real bug in a pass, a position table, a mask, a weight's storage or the device
compile would do; the proof must refuse every one. `apply` installs one for a compile;
`scripts/mutate.py` runs any of them over any fixture, `tests/mutation/test_mutants.py` a
selection in CI.

Every mutant returns how many edits it made (a hook counts its own in `Applied.edits`): a
mutant that edits nothing proves nothing, and the harness says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import openvino.opset13 as ops

MUTANTS: dict[str, Callable] = {}


def mutant(fn):
    MUTANTS[fn.__name__] = fn
    return fn


# ------------------------------------------------------------------------------- helpers
def port(model, name):
    """The output of the Parameter named `name`, or None."""
    for p in model.inputs:
        if name in p.get_names():
            return p.get_node().output(0)
    return None


def result_of(model, name):
    for r in model.get_results():
        if name in r.input_value(0).get_names() or name in r.output(0).get_names():
            return r
    return None


def i64(x):
    return ops.constant(np.asarray(x, np.int64))


def reroute(out, build) -> int:
    """Every consumer of `out` reads build(out) instead."""
    targets = list(out.get_target_inputs())
    new = build(out)
    new = new.output(0) if hasattr(new, "output") else new
    for t in targets:
        t.replace_source_output(new)
    return 1


def mask_keep(model, keep) -> int:
    """attention_mask * keep, keep[j] = keep(j, M): slots a model never attends."""
    m = port(model, "attention_mask")
    M = m.get_partial_shape()[1].get_length()
    row = np.array([[keep(j, M) for j in range(M)]], np.int64)
    return reroute(m, lambda x: ops.multiply(x, i64(row)))


def chunk_of(model) -> int:
    ids = port(model, "input_ids") or port(model, "inputs_embeds")
    return ids.get_partial_shape()[1].get_length()


def unchunked_prefill(name, model) -> bool:
    """The prefill model of a prompt at once: its mask spans its own rows alone (no past)."""
    m = port(model, "attention_mask")
    return name == "prefill" and m is not None and m.get_partial_shape()[1].get_length() == chunk_of(model)


def consts(model, pattern):
    rx = re.compile(pattern)
    return [op for op in model.get_ops() if op.get_type_name() == "Constant" and rx.search(op.get_friendly_name())]


def scalar(op) -> float | None:
    d = np.array(op.get_data())
    return float(d.ravel()[0]) if d.size == 1 else None


def edit_const(op, fn) -> int:
    """The constant's readers read fn(its values) instead, computed in the graph: the constant
    itself, a source weight, keeps the source's bytes, so the fault is the arithmetic's and the
    probes must find it (kvc.verify.weights refuses an edited weight before any probe runs:
    `edit_in_place`)."""
    data = np.array(op.get_data(), copy=True)
    delta = (fn(data).astype(data.dtype) - data).astype(data.dtype)
    return reroute(op.output(0), lambda x: ops.add(x, ops.constant(delta, dtype=op.get_element_type())))


def edit_in_place(op, fn) -> int:
    """The constant itself replaced by one holding fn(its values), under its name: what a pass
    that rewrote a weight would leave."""
    data = np.array(op.get_data(), copy=True)
    new = ops.constant(fn(data).astype(data.dtype), dtype=op.get_element_type())
    new.set_friendly_name(op.get_friendly_name())
    op.output(0).replace(new.output(0))
    return 1


def scale_weight(model, pattern, factor, where=None) -> int:
    def f(d):
        d = d.astype(np.float32)
        if where is None:
            return d * factor
        d[where] *= factor
        return d
    return sum(edit_const(op, f) for op in consts(model, pattern))


def scale_matmul_weight(matmul, factor: float) -> int:
    """`matmul` reads its constant weight `factor` times larger, computed in the graph (the
    constant's other readers, a tied embedding's Gather, read it as it is)."""
    weight = matmul.input_value(1)
    factor = ops.constant(np.array(factor, weight.get_element_type().to_dtype()))
    matmul.input(1).replace_source_output(ops.multiply(weight, factor).output(0))
    return 1


def generate(name) -> bool:
    return name.startswith("generate-")


# ------------------------------------------------------------------------------- mutants
@mutant
def none(name, model):
    """Nothing: the control (a compile that must pass)."""
    return 0




@mutant
def gen_positions_clamped_to_P(name, model):
    """generate: positions clamped to 63 (a position table or rope cache sized for P = 64, not
    P + R). Reached only by the far probes."""
    if not generate(name) or port(model, "position_ids") is None:
        return 0
    return reroute(port(model, "position_ids"), lambda p: ops.minimum(p, i64(63)))


@mutant
def prefill_positions_clamped_33(name, model):
    """the unchunked prefill model: positions clamped at 33 (a position table sized for 34).
    Published while its only probe was 33 tokens (the NPU's default prefill)."""
    if not unchunked_prefill(name, model) or port(model, "position_ids") is None:
        return 0
    return reroute(port(model, "position_ids"), lambda p: ops.minimum(p, i64(33)))


@mutant
def prefill_pad_row_attended(name, model):
    """the unchunked prefill model: its first slot (a pad row of every shorter prompt) attended
    by every row."""
    if not unchunked_prefill(name, model):
        return 0
    m = port(model, "attention_mask")
    row = np.zeros((1, m.get_partial_shape()[1].get_length()), np.int64)
    row[0, 0] = 1
    return reroute(m, lambda x: ops.maximum(x, i64(row)))


@mutant
def gen_last_past_slot_masked(name, model):
    """generate: the last past slot is never attended (the capacity read one row short)."""
    if not generate(name):
        return 0
    return mask_keep(model, lambda j, M: 0 if j == M - 2 else 1)


@mutant
def gen_past_middle_masked(name, model):
    """generate: past slots [M/2, 3M/4) never attended (a past read in two pieces that drops a
    stretch between them). No probe from position 0 fills them, and a far probe starts over
    empty rows."""
    if not generate(name):
        return 0
    return mask_keep(model, lambda j, M: 0 if M // 2 <= j < 3 * M // 4 else 1)


@mutant
def chunk_past_middle_masked(name, model):
    """the chunk prefill model never attends past slots [3M/8, M/2) (`gen_past_middle_masked`):
    beyond the rows the probes from position 0 write and before a far probe's origin."""
    if name != "prefill":
        return 0
    return mask_keep(model, lambda j, M: 0 if 3 * M // 8 <= j < M // 2 else 1)


def _past_values(model):
    """The outputs of the value past inputs (past_key_values.N.value)."""
    rx = re.compile(r"past_key_values\.\d+\.value$")
    return [p.get_node().output(0) for p in model.inputs if any(rx.search(n) for n in p.get_names())]


def past_rows(model, edit) -> int:
    """Every value past input read as edit(values, seq axis, rows) instead: the sequence axis is
    the last of the past's length (the mask's width less the new rows; values stored [B, H, D, S]
    too)."""
    ids = port(model, "input_ids") or port(model, "inputs_embeds")
    past = port(model, "attention_mask").get_partial_shape()[1].get_length() - ids.get_partial_shape()[1].get_length()
    n = 0
    for out in _past_values(model):
        dims = [d.get_length() for d in out.get_partial_shape()]
        if past not in dims:
            continue
        axis = max(i for i, d in enumerate(dims) if d == past)
        n += reroute(out, lambda x, axis=axis: edit(x, axis, past))
    return n


@mutant
def gen_past_values_shifted(name, model):
    """generate: the values of past slots [0.55 S, 0.8 S) read one slot late, the keys right (a
    gather of the past one off in a stretch no probe from position 0 reaches). Over a far past
    whose rows all shared one part, attention spread over them nearly cancelled the shift: in
    the blobs alone (bf16), it was published."""
    if not generate(name):
        return 0
    return past_rows(model, lambda x, axis, S: ops.gather(
        x, i64([j + 1 if 0.55 * S <= j < 0.8 * S else j for j in range(S)]), i64(axis)))


@mutant
def gen_past_values_zeroed(name, model):
    """generate: the values of past slots [0.8 S, S - 1) read as zeros (only a far probe reaches
    them). On a mixture of experts at bf16, one probe's NRMSE 15x the plugin's own drift, it
    was published as the one probe a router's flip excuses."""
    if not generate(name):
        return 0

    def zeroed(x, axis, S):
        keep = np.array([0.0 if 0.8 * S <= j < S - 1 else 1.0 for j in range(S)], np.float32)
        shape = [1] * len(x.get_partial_shape())
        shape[axis] = S
        return ops.multiply(x, ops.constant(keep.reshape(shape), dtype=x.get_element_type()))
    return past_rows(model, zeroed)


@mutant
def chunk_past_beyond_C_ignored(name, model):
    """the chunk prefill model reads only the first C slots of its past."""
    if name != "prefill":
        return 0
    C = chunk_of(model)
    return mask_keep(model, lambda j, M: 0 if C <= j < M - C else 1)


@mutant
def token_types_ignored(name, model):
    """every model: token_type_ids read as 0 (text), so an image's tokens attend each other
    causally, not both ways (Gemma 3). Only a probe with an image sees it (`media_probe`)."""
    types = port(model, "token_type_ids")
    return 0 if types is None else reroute(types, lambda t: ops.multiply(t, i64(0)))


@mutant
def large_first_token_types_ignored(name, model):
    """first-chunk models above 16 rows: every token read as text (the first chunk a Gemma 3
    image takes, `kvc.export.compile.resolve_first`; the 12-token image probe runs first-16)."""
    if not name.startswith("first-") or int(name.split("-")[1]) <= 16:
        return 0
    return token_types_ignored(name, model)


@mutant
def mrope_sections_collapsed(name, model):
    """every model: mRoPE's three position sections all read the first (t), as if a text
    token's: an image's h and w rows rotate wrongly (Qwen2-VL). Only a probe with an image
    sees it."""
    positions = port(model, "position_ids")
    if positions is None or positions.get_partial_shape().rank.get_length() != 3:
        return 0
    return reroute(positions, lambda p: ops.gather(p, i64([0, 0, 0]), i64(0)))


@mutant
def chunk_mrope_sections_collapsed(name, model):
    """the chunk prefill model alone: mRoPE's sections all read t (an image in a chunk call
    over a past; the first probe's image lies in the first call)."""
    return mrope_sections_collapsed(name, model) if name == "prefill" else 0


@mutant
def chunk_pad_slot_attended(name, model):
    """the chunk prefill model: every row attends the slot 9 before the end of its mask
    (column P - 9) whatever the mask says (an unmask-pad-rows that unmasked one fixed slot for
    every row, not each pad row its own slot). That slot is a valid row unless the call holds 8
    tokens or fewer: only prompts whose last chunk call holds 1 to 8 tokens are wrong. The
    compile's probes are C + 9, B + 9, F + B + 9 tokens: their partial chunk holds 9."""
    m = port(model, "attention_mask")
    if name != "prefill" or m is None or m.get_partial_shape()[1].get_length() <= chunk_of(model):
        return 0
    P = m.get_partial_shape()[1].get_length()
    row = np.zeros((1, P), np.int64)
    row[0, P - 9] = 1
    return reroute(m, lambda x: ops.maximum(x, i64(row)))


@mutant
def prefill_pad_slot_attended(name, model):
    """the unchunked prefill model (the NPU's default): every row attends the slot 9 before the
    end of its mask, a pad of every prompt of 8 tokens or fewer (its P - 1 token probe leaves
    only slot 0 a pad)."""
    if not unchunked_prefill(name, model):
        return 0
    m = port(model, "attention_mask")
    row = np.zeros((1, m.get_partial_shape()[1].get_length()), np.int64)
    row[0, -9] = 1
    return reroute(m, lambda x: ops.maximum(x, i64(row)))


@mutant
def large_first_pad_row_attended(name, model):
    """a first chunk of 64 static rows or more: its first slot (a pad row of every shorter
    prompt) attended by every row. At the CPU's bf16 default the first chunk of 128 runs
    prompts of 65 to 128 tokens; the probes ran it on 128 only."""
    m = port(model, "attention_mask")
    if not name.startswith("first-") or m is None or not m.get_partial_shape()[1].is_static \
            or m.get_partial_shape()[1].get_length() < 64:
        return 0
    row = np.zeros((1, m.get_partial_shape()[1].get_length()), np.int64)
    row[0, 0] = 1
    return reroute(m, lambda x: ops.maximum(x, i64(row)))


@mutant
def first_dynamic_rows_8_up(name, model):
    """a first chunk of dynamic rows: its token rows read 1% too large when the call holds 8
    rows or more but fewer than F (what a kernel chosen by the row count would do wrong; the
    compile's probes feed it 7 rows and F rows, `kvc verify`'s 1 and F)."""
    if not name.startswith("first-"):
        return 0
    ids = port(model, "input_ids")
    if ids is None or ids.get_partial_shape()[1].is_static:
        return 0
    F = int(name.split("-")[1])
    rows = ops.gather(ops.shape_of(ids, "i64"), i64(1), i64(0))
    inside = ops.logical_and(ops.greater_equal(rows, i64(8)), ops.less(rows, i64(F)))
    factor = ops.add(ops.constant(np.float32(1)), ops.multiply(ops.convert(inside, "f32"), ops.constant(np.float32(0.01))))
    n = 0
    for op in model.get_ops():
        if op.get_type_name() == "Gather" and op.input_value(1).get_node().get_type_name() in ("Convert", "Parameter") \
                and op.get_output_element_type(0).get_type_name() == "f32" and len(op.get_output_partial_shape(0)) == 3:
            n += reroute(op.output(0), lambda x: ops.multiply(x, factor))
            break
    return n


@mutant
def window_off_by_one(name, model):
    """every model: the sliding window's comparison one token short (kv > q - W + 1; Gemma 3's
    (q - kv) >= W as (q - kv) >= W - 1)."""
    n = 0
    compares = ("Greater", "GreaterEqual", "Less", "LessEqual")
    for op in model.get_ops():
        if op.get_type_name() == "Add" and any(t.get_node().get_type_name() in compares
                                               for t in op.output(0).get_target_inputs()):
            c = op.input_value(1).get_node()
            if c.get_type_name() == "Constant" and scalar(c) is not None and abs(scalar(c)) >= 4:
                n += edit_const(c, lambda d: d + 1)
        elif op.get_type_name() in compares and op.input_value(0).get_node().get_type_name() == "Subtract":
            c = op.input_value(1).get_node()
            if c.get_type_name() == "Constant" and scalar(c) is not None and abs(scalar(c)) >= 4:
                n += edit_const(c, lambda d: d - 1)
    return n


def _past_positions_from_one(setattr_, applied):
    from kvc.passes import mask_positions

    real = mask_positions.ops.range

    class OffByOne:
        def __getattr__(self, name):
            return getattr(ops, name)

        @staticmethod
        def range(start, stop, step, output_type="i64"):
            applied.edits["mask-positions"] = applied.edits.get("mask-positions", 0) + 1
            return real(ops.add(start, i64(1)), ops.add(stop, i64(1)), step, output_type=output_type)

    setattr_(mask_positions, "ops", OffByOne())


@mutant
def mask_positions_past_from_one(name, model):
    """the mask-positions pass numbers the past's positions from 1 (a window or a position
    table comparing the wrong slots)."""
    return 0


mask_positions_past_from_one.hooks = [_past_positions_from_one]


@mutant
def gen_o_proj_1e3(name, model):
    """generate: layer 1's o_proj 0.1% too large."""
    if not generate(name):
        return 0
    return scale_weight(model, r"layers\.1\.self_attn\.o_proj\.weight$", 1 + 1e-3)


@mutant
def gen_o_proj_3e2(name, model):
    """generate: layer 1's o_proj 3% too large."""
    if not generate(name):
        return 0
    return scale_weight(model, r"layers\.1\.self_attn\.o_proj\.weight$", 1.03)


@mutant
def gen_o_proj_1e1(name, model):
    """generate: layer 1's o_proj 10% too large (a router's wide bounds over an f16 cache, the
    NPU's, let it through)."""
    if not generate(name):
        return 0
    return scale_weight(model, r"layers\.1\.self_attn\.o_proj\.weight$", 1.1)


@mutant
def gen_o_proj_3e1(name, model):
    """generate: layer 1's o_proj 30% too large (a router's wide bounds at bf16 let it through)."""
    if not generate(name):
        return 0
    return scale_weight(model, r"layers\.1\.self_attn\.o_proj\.weight$", 1.3)


@mutant
def first_q_proj_one_row_1e2(name, model):
    """first-chunk models: one output row of layer 0's q_proj 1% too large."""
    if not name.startswith("first-"):
        return 0
    return scale_weight(model, r"layers\.0\.self_attn\.q_proj\.weight$", 1.01, where=(5,))


@mutant
def all_rms_eps_1e5(name, model):
    """every model: an RMSNorm epsilon of 1e-5 for 1e-6."""
    n = 0
    for op in model.get_ops():
        if op.get_type_name() == "Add" and op.input_value(0).get_node().get_type_name() == "ReduceMean":
            c = op.input_value(1).get_node()
            if c.get_type_name() == "Constant" and scalar(c) is not None and 0 < scalar(c) < 1e-4:
                n += edit_const(c, lambda d: d * 10)
    return n


def _geometric(model, first) -> list:
    """[1, n, 1] float constants that fall geometrically from a first value `first` accepts:
    ALiBi's slopes (below 1), RoPE's inverse frequencies (1)."""
    found = []
    for op in consts(model, r"."):
        d = np.array(op.get_data())
        if d.ndim == 3 and d.shape[0] == 1 and d.shape[2] == 1 and d.shape[1] >= 2 and d.dtype.kind == "f":
            v = d.ravel().astype(np.float64)
            if first(v[0]) and v[1] < v[0] and np.allclose(v[1:] / v[:-1], v[1] / v[0], rtol=1e-3):
                found.append(op)
    return found


@mutant
def gen_alibi_slopes_5pct(name, model):
    """generate: ALiBi slopes 5% too large."""
    if not generate(name):
        return 0
    return sum(edit_const(op, lambda d: d * 1.05) for op in _geometric(model, lambda v: v < 1))


@mutant
def gen_tied_lm_head_1e2(name, model):
    """generate: the lm_head MatMul reads a copy of the tied embedding 1% larger."""
    if not generate(name):
        return 0
    return sum(scale_matmul_weight(op, 1.01) for op in model.get_ops()
               if op.get_type_name() == "MatMul" and op.input_value(1).get_node().get_type_name() == "Constant"
               and any(t.get_node().get_type_name() == "Gather" for t in op.input_value(1).get_target_inputs()))


@mutant
def chunk_swap_present_kv_layer1(name, model):
    """the chunk prefill model writes layer 1's keys and values into each other's buffers."""
    if name != "prefill":
        return 0
    rk, rv = result_of(model, "present.1.key"), result_of(model, "present.1.value")
    a, b = rk.input_value(0), rv.input_value(0)
    rk.input(0).replace_source_output(b)
    rv.input(0).replace_source_output(a)
    return 1


@mutant
def gen_layer1_reads_layer0_past(name, model):
    """generate: layer 1 attends over layer 0's past (a layer index off by one)."""
    if not generate(name):
        return 0
    for kind in ("key", "value"):
        p0, p1 = port(model, f"past_key_values.0.{kind}"), port(model, f"past_key_values.1.{kind}")
        for t in list(p1.get_target_inputs()):
            t.replace_source_output(p0)
    return 1


@mutant
def gen_router_gate_1e2(name, model):
    """generate: the mixture-of-experts router's weights 1% too large."""
    if not generate(name):
        return 0
    routers = [op.input_value(0).get_node() for op in model.get_ops()
               if op.get_type_name() == "Softmax" and op.get_output_partial_shape(0).rank.get_length() == 2]
    return sum(scale_matmul_weight(mm, 1.01) for mm in routers
               if mm.get_type_name() == "MatMul" and mm.input_value(1).get_node().get_type_name() == "Constant")


@mutant
def gen_expert_in_place_1e2(name, model):
    """generate: expert 3's gate and up weights 1% too large in the constant itself, under its
    name (a pass that rewrote a weight). No probe need read an expert: tests/export/
    test_weights_check.py shows one the router never picks passing every probe."""
    if not generate(name):
        return 0
    def f(d):
        d = d.astype(np.float32)
        d[3] *= 1.01
        return d
    return sum(edit_in_place(op, f) for op in consts(model, r"experts\.gate_up_proj$"))


def swap_experts(model, a: int = 2, b: int = 3) -> int:
    """Experts `a` and `b` each computed with the other's down projection, every weight kept
    under its name with its bytes (what a pass that miswired experts would leave): a batched
    weight [E, ...] (GPT-OSS, Qwen3-MoE) read through a Gather that swaps its rows a and b; one
    MatMul per expert (GraniteMoE after dense-experts, `select/Gather_<2e+1>` for expert e)
    given the other's weight."""
    batched = consts(model, r"experts\.down_proj$")
    if batched:
        def permuted(x):
            order = list(range(x.get_partial_shape()[0].get_length()))
            order[a], order[b] = b, a
            return ops.gather(x, i64(order), i64(0))
        return sum(reroute(op.output(0), permuted) for op in batched)
    edits = 0
    for layer in {m[1] for op in consts(model, r"output_linear/aten::select/Gather_\d+$")
                  if (m := re.search(r"layers\.(\d+)\.", op.get_friendly_name()))}:
        pair = [consts(model, rf"layers\.{layer}\.block_sparse_moe\.output_linear/aten::select/Gather_{2 * e + 1}$")[0]
                for e in (a, b)]
        users = [list(op.output(0).get_target_inputs()) for op in pair]
        for targets, other in zip(users, reversed(pair)):
            for t in targets:
                t.replace_source_output(other.output(0))
        edits += 1
    return edits


@mutant
def gen_experts_2_3_swapped(name, model):
    """generate: experts 2 and 3 each computed with the other's down projection, their weights
    unchanged. Only a probe that routes to 2 or 3 runs the fault: with a router that never picks
    them (tests/export/test_experts.py), only the forced check (kvc.verify.experts) does."""
    return swap_experts(model) if generate(name) else 0


def pair_weight_moved(model, a: int, b: int, c: int, layer: int = 1) -> int:
    """Layer `layer`'s routers (a TopK over [rows, E]): where a token's two experts are {a, b},
    the routing weight meant for b is scattered into expert c's column, every weight kept."""
    edits = 0
    for tk in model.get_ordered_ops():
        shape = tk.get_output_partial_shape(1) if tk.get_type_name() == "TopK" else None
        if shape is None or shape.rank.get_length() != 2 or f"layers.{layer}." not in tk.get_friendly_name():
            continue
        dtype = tk.get_output_element_type(1).to_dtype()

        def build(x, dtype=dtype):
            def c_(v):
                return ops.constant(np.array(v, dtype))
            lo, hi = ops.reduce_min(x, i64([1]), True), ops.reduce_max(x, i64([1]), True)
            pair = ops.logical_and(ops.equal(lo, c_(min(a, b))), ops.equal(hi, c_(max(a, b))))
            return ops.select(ops.logical_and(pair, ops.equal(x, c_(b))), c_(c), x)
        edits += reroute(tk.output(1), build)
    return edits


@mutant
def gen_pair_0_5_weight_to_6(name, model):
    """generate: a token routed to experts 0 and 5 together has 5's weight scattered into
    expert 6's column (8 experts or more). Forced by position alone the pairs were always
    {0, 1}, {2, 3}, ..., and qwen2_moe's routers never pick {0, 5} on a probe: published."""
    return pair_weight_moved(model, 0, 5, 6) if generate(name) else 0


@mutant
def prefill_experts_2_3_swapped(name, model):
    """prefill, chunk and first-chunk models: experts 2 and 3 swapped (`gen_experts_2_3_swapped`)."""
    return 0 if generate(name) else swap_experts(model)


@mutant
def all_int4_zero_point_one_group(name, model):
    """every model: one int4 group of the first [64, 4, 16] weight decompressed with its zero
    point off by one."""
    for op in model.get_ordered_ops():
        if (op.get_type_name() == "Constant" and op.get_element_type().get_type_name() in ("i4", "u4")
                and list(op.get_output_shape(0)) == [64, 4, 16]):
            convert = next(t.get_node() for t in op.output(0).get_target_inputs())
            delta = np.zeros((64, 4, 16), np.float32)
            delta[3, 1, :] = 1
            et = convert.get_output_element_type(0).to_dtype()
            return reroute(convert.output(0), lambda x: ops.subtract(x, ops.constant(delta.astype(et))))
    return 0


@mutant
def gen_rope_theta_1e3(name, model):
    """generate: RoPE's inverse frequencies 0.1% too low (a rope_theta read slightly wrong)."""
    if not generate(name):
        return 0
    return sum(edit_const(op, lambda d: d * np.float32(1 - 1e-3)) for op in _geometric(model, lambda v: v == 1))


@mutant
def gen_attention_scale_1e2(name, model):
    """generate: attention scores scaled 1% too much (a head size or scale read wrong)."""
    if not generate(name):
        return 0
    n = 0
    for op in model.get_ops():  # the scale: a scalar in (0, 1) that a ConvertLike feeds toward a Softmax
        if op.get_type_name() == "ConvertLike" and "attention" in op.get_friendly_name():
            c = op.input_value(0).get_node()
            if c.get_type_name() == "Constant" and scalar(c) is not None and 0 < scalar(c) < 1:
                n += edit_const(c, lambda d: d * 1.01)
    return n


@mutant
def all_int8_scale_one_channel_1e2(name, model):
    """every model: one output channel of the first 8-bit weight decompressed with a scale 1% too
    large."""
    for op in model.get_ordered_ops():
        if (op.get_type_name() == "Constant" and op.get_element_type().get_type_name() in ("i8", "u8")
                and len(op.get_output_shape(0)) == 2 and op.get_output_shape(0)[1] > 1):
            node = next(t.get_node() for t in op.output(0).get_target_inputs())  # Convert
            while node.get_type_name() != "Multiply":
                node = next(t.get_node() for t in node.output(0).get_target_inputs())
            rows = node.get_output_shape(0)[0]
            factor = np.ones((rows, 1), np.float32)
            factor[3] = 1.01
            et = node.get_output_element_type(0).to_dtype()
            return reroute(node.output(0), lambda x: ops.multiply(x, ops.constant(factor.astype(et))))
    return 0


def _flip_a_weight_bit(setattr_, applied, bit: int = 22):
    """After the IR is saved and before it is verified, one bit of one element of the first
    f32 [64, 64] weight in weights.bin flipped (a storage error)."""
    import xml.etree.ElementTree as ET
    from pathlib import Path

    import kvc.export.compile as compile_module

    real = compile_module._verify_ir

    def flipped(model_path, work, *args, **kwargs):
        work = Path(work)
        for layer in ET.parse(work / "prefill.xml").getroot().iter("layer"):
            data = layer.find("data")
            if (layer.get("type") == "Const" and data.get("element_type") == "f32"
                    and data.get("shape") == "64,64"):
                offset = int(data.get("offset")) + 4 * 100
                with open(work / "weights.bin", "r+b") as f:
                    f.seek(offset)
                    value = np.frombuffer(f.read(4), np.uint32) ^ np.uint32(1 << bit)
                    f.seek(offset)
                    f.write(value.tobytes())
                applied.edits["weights.bin"] = 1
                break
        return real(model_path, work, *args, **kwargs)

    setattr_(compile_module, "_verify_ir", flipped)


@mutant
def weights_bin_mantissa_bit(name, model):
    """weights.bin: the top mantissa bit of one weight flipped after saving."""
    return 0


weights_bin_mantissa_bit.hooks = [_flip_a_weight_bit]


# ------------------------------------------------------------------------------- the harness
@dataclass
class Applied:
    """What a mutant edited, by static model."""

    edits: dict[str, int] = field(default_factory=dict)


def apply(name: str, setattr_, setenv, where: str = "ir") -> Applied:
    """Install mutant `name` for the compiles that follow, through `setattr_(obj, attr, value)`
    and `setenv(key, value)` (pytest's monkeypatch, or plain setattr and os.environ for a
    script). `where`: "ir" (every static model before it is written) or "blob" (only what the
    device compile reads, which then runs in kvc's own process)."""
    fn = MUTANTS[name]
    applied = Applied()
    for hook in getattr(fn, "hooks", ()):  # edits they make are counted in `applied` too
        hook(setattr_, applied)
    if where == "ir":
        import kvc.ir.bundle as bundle

        real_add = bundle.Bundle.add

        def add(self, model_name, model):
            n = fn(model_name, model)
            if n:
                applied.edits[model_name] = n
                model.validate_nodes_and_infer_types()
            return real_add(self, model_name, model)

        setattr_(bundle.Bundle, "add", add)
    elif where == "blob":
        import threading
        from pathlib import Path

        import kvc.export.device_compile as device_compile
        import kvc.ir.reader as reader

        real_compile, real_load = device_compile._compile_one, reader.load
        compiling = threading.local()  # the CPU compiles run beside the numpy check, on a thread

        def load(path, *args, **kwargs):
            model = real_load(path, *args, **kwargs)
            if getattr(compiling, "now", False):
                model_name = Path(str(path)).stem
                n = fn(model_name, model)
                if n:
                    applied.edits[model_name] = applied.edits.get(model_name, 0) + n
                    model.validate_nodes_and_infer_types()
            return model

        def compile_one(request):  # each static model it reads, and nothing else, mutated
            compiling.now = True
            try:
                return real_compile(request)
            finally:
                compiling.now = False

        setenv("KVC_DEVICE_COMPILE", "in-process")  # the patch reaches this process only
        setattr_(device_compile, "_compile_one", compile_one)
        setattr_(reader, "load", load)
    else:
        raise ValueError(f"where: 'ir' or 'blob', not {where!r}")
    return applied


@dataclass
class InPasses(Applied):
    """What a mutant installed in the passes edited (`edits`, by branch or patched pass), each
    branch's last pass (`last`: where its edit of that branch is made) and the stable names of
    the values its new nodes feed in each branch it edited (`fed`: where its fault shows first)."""

    last: dict[str, str] = field(default_factory=dict)
    fed: dict[str, list[str]] = field(default_factory=dict)


def apply_in_passes(name: str, setattr_) -> InPasses:
    """Install mutant `name` *in the passes*, for `kvc bisect` (which walks the passes and
    builds no bundle, so `apply` does not reach it): the last pass of every static branch
    (kvc.export.build.branch_passes) also makes the mutant's edit of that branch's model, after
    its own work, so the truth bisect must find is that pass; a mutant's `hooks` (a patched
    pass) are installed as `apply` installs them."""
    import dataclasses

    import kvc.export.build as build
    from kvc.ir.naming import name_model
    from kvc.passes.framework.base import PassResult

    fn, applied, real = MUTANTS[name], InPasses(), build.branch_passes
    for hook in getattr(fn, "hooks", ()):
        hook(setattr_, applied)

    def mutated(last, branch: str):
        cls = type(last)

        def run(self, model):
            result = cls.run(self, model)
            before = {op.get_friendly_name() for op in result.model.get_ops()}
            n = fn(branch, result.model)
            if not n:
                return result
            applied.edits[branch] = n
            result.model.validate_nodes_and_infer_types()
            naming = name_model(result.model)
            applied.fed[branch] = [naming.value(out) for op in result.model.get_ordered_ops()
                                   if op.get_friendly_name() in before
                                   and any(v.get_node().get_friendly_name() not in before for v in op.input_values())
                                   for out in op.outputs() if (op, out.get_index()) in naming._values]
            return PassResult(result.model, True)

        sub = type(cls.__name__, (cls,), {"run": run, "__module__": cls.__module__})
        return sub(**{f.name: getattr(last, f.name) for f in dataclasses.fields(last)})

    def with_mutant(options):
        branches = real(options)
        applied.last.update({b: passes[-1].spec() for b, passes in branches.items()})
        return {b: [*passes[:-1], mutated(passes[-1], b)] for b, passes in branches.items()}

    setattr_(build, "branch_passes", with_mutant)
    return applied

