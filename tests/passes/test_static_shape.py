"""static-shape, kv-io and mask-positions produce the NPU's static contract (REFERENCE.md §4)."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.errors import UsageError
from kvc.passes import PassFailure, PassManager, parse_pipeline
from kvc.plan import plan_lengths


def run(name, spec):
    return PassManager(parse_pipeline(spec), use_env=False).run(ir.load(fixtures.path(name))).model


def shapes(ports):
    return {p.get_any_name(): (list(p.get_shape()), p.get_element_type().get_type_name()) for p in ports}


# -- length planning ------------------------------------------------------------------------
def test_plan_aligns_like_npuw_and_says_so():
    plan = plan_lengths(100, 100)
    assert (plan.prompt, plan.response, plan.sizes) == (128, 128, (256,))
    assert plan.notes == ("max prompt length 100 aligned up to 128 (multiple of 64)",
                          "min response length 100 aligned up to 128 (multiple of 64)")
    assert plan_lengths(1024, 128).notes == ()


def test_default_lengths_fit_the_models_positions():
    """Unset lengths are NPUW's 1024 + 128, with P lowered (in steps of 64, or of the chunk) so
    that P + R fits the positions the model states; lengths the user sets are kept."""
    assert (plan_lengths().prompt, plan_lengths().capacity) == (1024, 1152)
    assert plan_lengths(max_positions=4096).notes == ()
    fitted = plan_lengths(max_positions=256)
    assert (fitted.prompt, fitted.response, fitted.capacity) == (128, 128, 256)
    assert fitted.notes == ("max prompt length 1024 lowered to 128 so that P + R fits the model's 256 positions "
                            "(config.json); --max-prompt-len sets it",)
    assert plan_lengths(max_positions=1000).prompt == 832  # 872 down to a multiple of 64
    assert plan_lengths(chunk=256, max_positions=1000).prompt == 768
    assert plan_lengths(max_positions=100).prompt == 64  # not below one step: beyond, and warned
    assert plan_lengths(max_positions=1).notes == (  # and the note does not claim it fits
        "max prompt length 1024 lowered to 64, the least it can be: P + R cannot fit the model's 1 positions "
        "(config.json) with a min response length of 128",)
    assert plan_lengths(1024, max_positions=256).prompt == 1024  # asked for: kept
    assert plan_lengths(None, 64, max_positions=256).prompt == 1024


def test_plan_chunk_rules():
    assert plan_lengths(192, 64, chunk=128).prompt == 256
    whole = plan_lengths(64, 64, chunk=64)  # one chunk, no past: the whole prompt
    assert (whole.prompt, whole.chunk) == (64, 0) and "the whole prompt at once" in whole.notes[-1]
    with pytest.raises(UsageError, match="power of two"):
        plan_lengths(256, 64, chunk=48)
    with pytest.raises(UsageError, match="exceeds the max prompt length"):
        plan_lengths(64, 64, chunk=128)


def test_plan_bulk_chunk_rules():
    """Several sizes: the smallest is the chunk (P aligned to it), the larger ones bulk chunks,
    each below P (else dropped, said); all powers of two, and 0 alone."""
    L = plan_lengths(1000, 64, chunk=(512, 64))
    assert (L.prompt, L.chunk, L.bulk) == (1024, 64, (512,)) and L.to_dict()["prefill_bulk_chunks"] == [512]
    L = plan_lengths(256, 64, chunk=(64, 256, 128))
    assert (L.chunk, L.bulk) == (64, (128,)) and L.notes == ("prefill bulk chunk 256 dropped: not below the max "
                                                               "prompt length 256",)
    L = plan_lengths(None, None, chunk=(64, 512), max_positions=256)  # P lowered to 128: no room for the bulk
    assert (L.prompt, L.chunk, L.bulk) == (128, 64, ())
    L = plan_lengths(1700, 128, chunk=(16, 128))  # P a multiple of every chunk: the pass refused 1728 at bulk 128
    assert (L.prompt, L.chunk, L.bulk) == (1792, 16, (128,)) and L.notes == (
        "max prompt length 1700 aligned up to 1728 (multiple of 64)",
        "max prompt length 1728 aligned up to 1792 (multiple of the bulk chunk 128)")
    L = plan_lengths(None, None, chunk=(16, 128), max_positions=1000)  # lowered to fit, by the bulk chunk's steps
    assert (L.prompt, L.bulk) == (768, (128,)) and L.prompt + L.response <= 1000
    with pytest.raises(UsageError, match="power of two, got 64,96"):
        plan_lengths(256, 64, chunk=(64, 96))
    with pytest.raises(UsageError, match="cannot be combined"):
        plan_lengths(256, 64, chunk=(0, 64))
    assert plan_lengths(256, 64, chunk=(64,)).bulk == ()


def test_plan_first_chunk_rules():
    """First chunks: any size below P, else dropped with the reason; none without a chunk;
    positive sizes only."""
    L = plan_lengths(64, 64, chunk=16, first=(64, 24, 32))
    assert L.first == (24, 32) and L.to_dict()["prefill_first_chunks"] == [24, 32]
    assert L.notes == ("first prefill chunk 64 dropped: not below the max prompt length 64",)
    L = plan_lengths(64, 64, chunk=0, first=(32,))
    assert L.first == () and L.notes == ("first prefill chunk 32 dropped: the prefill is not chunked",)
    with pytest.raises(UsageError, match="must be positive sizes"):
        plan_lengths(64, 64, chunk=16, first=(0,))


def test_plan_first_chunk_of_dynamic_rows_rules():
    """A first chunk of dynamic rows is one size; one not below P is lowered to P - C (the
    bundled model's P of 128 keeps one), not dropped; the manifest's lengths say "dynamic"
    and read back; a manifest saying so with two first chunks is refused."""
    from kvc.plan import LengthPlan

    L = plan_lengths(1024, 128, chunk=(32, 256), first=(256,), first_rows="dynamic")
    assert (L.first, L.first_dynamic, L.notes) == ((256,), True, ())
    assert LengthPlan.from_dict(L.to_dict()) == L and L.to_dict()["prefill_first_rows"] == "dynamic"
    L = plan_lengths(128, 64, chunk=32, first=(256,), first_rows="dynamic")
    assert (L.first, L.first_dynamic) == ((96,), True)
    assert L.notes == ("first prefill chunk 256 lowered to 96: its rows are dynamic, up to the max prompt length 128 "
                       "less one chunk",)
    assert "prefill_first_rows" not in plan_lengths(64, 64, chunk=16, first=(32,)).to_dict()  # static: as before
    L = plan_lengths(64, 64, chunk=0, first=(32,), first_rows="dynamic")
    assert (L.first, L.first_dynamic) == ((), False)
    with pytest.raises(UsageError, match="one size, 1 to F rows; got first chunks \\[16, 128\\]"):
        plan_lengths(1024, 128, chunk=32, first=(16, 128), first_rows="dynamic")
    with pytest.raises(UsageError, match="must be static or dynamic"):
        plan_lengths(1024, 128, chunk=32, first=(16,), first_rows="ragged")
    bad = {**plan_lengths(1024, 128, chunk=32, first=(16, 128)).to_dict(), "prefill_first_rows": "dynamic"}
    with pytest.raises(ValueError, match="dynamic with one first chunk"):
        LengthPlan.from_dict(bad)


def test_static_shape_with_dynamic_rows_leaves_only_the_rows_dynamic():
    """static-shape{rows=dynamic}: the token inputs and the mask [1, ?], the past empty; kv-io
    then removes the past and slices the logits to the last row, [1, 1, V], which is the
    unpadded model's last row for any row count (OpenVINO CPU). A chunk is refused."""
    import openvino as ov

    model = run("llama", "lift-state,static-shape{kind=prefill,prompt=32,rows=dynamic},kv-io{slice_logits=true}")
    ins = {p.get_any_name(): str(p.get_partial_shape()) for p in model.inputs}
    assert ins == {"input_ids": "[1,?]", "attention_mask": "[1,?]", "position_ids": "[1,?]"}
    assert model.output("logits").get_partial_shape().is_static and model.output("logits").get_shape()[1] == 1
    full = run("llama", "lift-state,static-shape{kind=prefill,prompt=32,rows=dynamic},kv-io")
    core = ov.Core()
    sliced, whole = (core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}) for m in (model, full))
    for n in (1, 5, 32):
        feed = {"input_ids": np.arange(3, 3 + n)[None], "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n)[None]}
        last, every = sliced(feed)["logits"], whole(feed)["logits"]
        assert last.shape[1] == 1 and every.shape[1] == n
        np.testing.assert_array_equal(last[0, 0], every[0, -1])
    with pytest.raises(PassFailure, match="rows=dynamic is for a prefill without a chunk"):
        run("llama", "lift-state,static-shape{kind=prefill,prompt=32,chunk=16,rows=dynamic}")


def test_static_but_rows_names_an_input_dynamic_beyond_its_rows():
    """The invariant static-shape{rows=dynamic} ensures: a past input left dynamic breaks it."""
    from kvc.passes.framework.invariants import check

    model = run("llama", "lift-state")
    name, reason = check(("static-but-rows",), model)
    assert name == "static-but-rows" and "beyond the rows of a token input" in reason
    assert check(("static-but-rows",), run("llama", "lift-state,static-shape{kind=prefill,prompt=32,rows=dynamic}")) \
        is None


# The NPU plugin's own sizes, from its rule (npuw/llm_compiled_model.cpp,
# create_generate_model_variants: 1024 * 2^k + R while <= P + R, then P + R), after its
# alignments (P and R up to 64, P up to the chunk).
NPUW_PYRAMID = [
    ((1024, 128, 0), (1152,)),
    ((2048, 128, 0), (1152, 2176)),
    ((4096, 256, 0), (1280, 2304, 4352)),
    ((4096, 128, 0), (1152, 2176, 4224)),
    ((3000, 128, 0), (1152, 2176, 3136)),  # P aligned up to 3008: 2048 + 128 <= 3136 < 4096 + 128
    ((3000, 128, 1024), (1152, 2176, 3200)),  # P aligned up to the chunk: 3072
    ((128, 64, 0), (192,)),
    ((64, 64, 0), (128,)),
    ((1000, 100, 0), (1152,)),  # P 1024, R 128 after alignment
    ((1025, 128, 0), (1152, 1216)),
]


@pytest.mark.parametrize("asked, sizes", NPUW_PYRAMID, ids=[f"P{a[0]}-R{a[1]}-C{a[2]}" for a, _ in NPUW_PYRAMID])
def test_pyramid_is_the_npu_plugins(asked, sizes):
    p, r, chunk = asked
    assert plan_lengths(p, r, chunk=chunk, variants="pyramid").sizes == sizes
    assert plan_lengths(p, r, chunk=chunk).sizes == sizes  # the default, as NPUW_LLM_GENERATE_PYRAMID's


def test_plan_variants():
    assert plan_lengths(4096, 128, variants="single").sizes == (4224,)
    assert plan_lengths(64, 32, variants=(80,)).sizes == (80, 128)  # R 32 aligns up to 64
    assert "generate variant 128 (= P + R) added" in plan_lengths(64, 32, variants=(80,)).notes[-1]
    with pytest.raises(UsageError, match="exceeds the KV capacity P \\+ R = 64 \\+ 64 = 128"):
        plan_lengths(64, 32, variants=(200,))


# -- shapes -----------------------------------------------------------------------------------
def tokens(ins: dict, rows: int, cfg: dict) -> bool:
    """The token input holds `rows` rows: ids [1, rows], or a vision-language model's language
    model's inputs_embeds [1, rows, H]."""
    if "inputs_embeds" in ins:
        return "input_ids" not in ins and ins["inputs_embeds"] == ([1, rows, cfg["hidden_size"]], "f32")
    return ins["input_ids"] == ([1, rows], "i64")


def test_prefill_shapes(fixture_name):
    cfg = fixtures.goldens(fixture_name)["config"]
    heads = cfg["num_key_value_heads"] or cfg["num_attention_heads"]
    model = run(fixture_name, "lift-state,dense-experts,static-shape{kind=prefill,prompt=64},mask-positions,kv-io")
    ins = shapes(model.inputs)
    assert tokens(ins, 64, cfg) and ins["attention_mask"] == ([1, 64], "i64")
    assert not any(n.startswith("past_key_values") for n in ins), "empty past inputs are removed"
    outs = shapes(model.outputs)
    assert outs["logits"][0] == [1, 64, cfg["vocab_size"]]
    assert outs["present.0.key"] == ([1, heads, 64, cfg["head_dim"]], "f32")


def test_chunked_prefill_and_generate_shapes(fixture_name):
    cfg = fixtures.goldens(fixture_name)["config"]
    chunked = run(fixture_name, "lift-state,dense-experts,static-shape{kind=prefill,prompt=64,chunk=16},kv-io")
    ins, outs = shapes(chunked.inputs), shapes(chunked.outputs)
    assert tokens(ins, 16, cfg) and ins["attention_mask"][0] == [1, 64]
    assert ins["past_key_values.1.value"][0][2] == 48 and outs["present.1.value"][0][2] == 16
    gen = run(fixture_name, "lift-state,dense-experts,static-shape{kind=generate,size=96},kv-io{kv_type=f16,transpose_v=true}")
    ins, outs = shapes(gen.inputs), shapes(gen.outputs)
    assert tokens(ins, 1, cfg) and ins["attention_mask"][0] == [1, 96]
    assert ins["past_key_values.0.key"][0][2] == 95 and ins["past_key_values.0.key"][1] == "f16"
    assert ins["past_key_values.0.value"][0][2:] == [cfg["head_dim"], 95], "V transposed: sequence last"
    assert outs["present.0.value"] == ([1, ins["past_key_values.0.value"][0][1], cfg["head_dim"], 1], "f16")
    assert outs["logits"][0] == [1, 1, cfg["vocab_size"]]


def test_prefill_logits_sliced_to_last_position():
    model = run("llama", "lift-state,dense-experts,static-shape{kind=prefill,prompt=64},kv-io{slice_logits=true}")
    assert shapes(model.outputs)["logits"][0] == [1, 1, 384]


def test_every_static_model_compiles_for_cpu(fixture_name):
    for spec in ("static-shape{kind=prefill,prompt=64}", "static-shape{kind=generate,size=96}"):
        ir.core().compile_model(run(fixture_name, f"lift-state,dense-experts,{spec},mask-positions,kv-io,lower-kvcache"), "CPU")


def test_stateful_model_is_refused():
    with pytest.raises(PassFailure, match="still stateful; run lift-state first"):
        run("llama", "static-shape{kind=prefill,prompt=64}")


def test_unknown_dynamic_input_fails_preflight_naming_it():
    model = PassManager(parse_pipeline("lift-state"), use_env=False).run(ir.load(fixtures.path("llama"))).model
    extra = ops.parameter([-1, 3], np.float32, name="mystery")
    extra.output(0).set_names({"mystery"})
    model.add_parameters([extra])
    with pytest.raises(PassFailure, match="no static shape is known for input mystery \\[\\?,3\\]"):
        PassManager(parse_pipeline("static-shape{kind=generate,size=96}"), use_env=False).run(model)


def _mask_positions(name):
    m = run(name, "lift-state,dense-experts,static-shape{kind=generate,size=96}")
    return PassManager(parse_pipeline("mask-positions"), use_env=False).run(m).records[0]


def test_mask_positions_applies_only_to_slot_indexed_masks_and_biases():
    """Each of its rules fires where the export measures a distance on cache slots, and
    nothing changes where slot order is all that matters."""
    hits = {name: (r.modified, r.rule_hits) for name in ("mistral", "gpt_neo", "mpt", "llama", "bloom",
                                                         "gpt_neox_japanese", "llama4") for r in [_mask_positions(name)]}
    assert hits["mistral"] == (True, {"mask-positions/index-compare": 2})  # sliding window + causal
    assert hits["gpt_neo"][0] and hits["gpt_neo"][1]["mask-positions/band-table"] == 1  # the local layer only
    assert hits["mpt"] == (True, {"mask-positions/right-aligned-table": 1})  # one ALiBi table for all layers
    assert hits["llama"] == (False, {"mask-positions/index-compare": 1})  # causal only: kept
    assert hits["bloom"] == (False, {})  # ALiBi from cumsum(attention_mask) already follows positions
    # rotary positions from arange(q) + the past's length, one cache_position for all layers
    assert hits["gpt_neox_japanese"] == (True, {"mask-positions/slot-positions": 1})
    # Llama 4's chunked attention, floor(q / 16) == floor(kv / 16) on slots, beside the causal
    # one; and its attention temperature, which reads cache_position as a position
    assert hits["llama4"] == (True, {"mask-positions/index-compare": 2, "mask-positions/slot-positions": 1})


def test_mask_positions_says_why_a_causal_band_table_is_kept():
    misses = [m for m in _mask_positions("gpt_neo").rule_misses if m[0] == "mask-positions/band-table"]
    assert any("plain causal (tril): slot order is position order" in reason for _, _, reason in misses)


@pytest.mark.parametrize("name", ["gpt_neo", "mpt", "gpt_neox_japanese"])
def test_without_mask_positions_the_static_models_compute_something_else(name, monkeypatch):
    """The rules are what makes these models right under the static contract: the same
    pipeline without mask-positions diverges from the stateful model."""
    import kvc.export.build as build
    from kvc.passes.mask_positions import MaskPositions
    from kvc.plan import StaticOptions
    from kvc.runtime.generate import greedy
    from kvc.runtime.session import NumpySession, open_session
    from kvc.runtime.static_pipeline import StaticPipeline

    real = build.branch_passes
    monkeypatch.setattr(build, "branch_passes", lambda options: {
        branch: [p for p in passes if not isinstance(p, MaskPositions)] for branch, passes in real(options).items()})
    static = build.build_static(ir.load(fixtures.path(name)), StaticOptions(64, 64, kv_precision="f32"), use_env=False)
    pipe = StaticPipeline(NumpySession(static.models["prefill"]),
                          {size: NumpySession(static.models[n]) for size, n in static.generate_names.items()},
                          static.plan)
    prompt = fixtures.goldens(name)["prompts"][2]["ids"]  # the long prompt, past the window
    ref = greedy(open_session(fixtures.path(name), "openvino"), prompt, 8)
    assert pipe.generate(prompt, 8).tokens != ref.tokens


def test_static_golden_ir(golden):
    from tests.passes.models import kv_model
    ids = ["past_key_values.0.keypresent.0.key", "past_key_values.0.valuepresent.0.value"]
    model = kv_model(ids)
    lifted = PassManager(parse_pipeline("lift-state"), use_env=False).run(model).model
    # The toy model's x is this step's rows; static-shape knows it only as a KV-carrying graph,
    # so name it input_ids' companion the way a real model would be reshaped.
    lifted.reshape({"x": [1, 2, 1, 4], "past_key_values.0.key": [1, 2, 7, 4], "past_key_values.0.value": [1, 2, 7, 4]})
    out = PassManager(parse_pipeline("kv-io{kv_type=f16,transpose_v=true}"), use_env=False).run(lifted).model
    golden("kv-io/toy.generate.f16.transpose_v", ir.to_text(out))


def test_shape_constants_that_do_not_follow_the_inputs_fall_back_to_openvinos_reshape():
    """A Reshape to a hard-coded [4] cannot take 64 tokens by shape inference alone;
    OpenVINO's SmartReshape (run by Model.reshape) rewrites it to [-1], and static-shape
    falls back to it."""
    model = PassManager(parse_pipeline("lift-state"), use_env=False).run(ir.load(fixtures.path("llama"))).model
    ids = next(p for p in model.inputs if "input_ids" in p.get_names())
    flat = ops.reshape(ids, ops.constant(np.array([4], np.int64)), False)
    flat.output(0).set_names({"flat_ids"})
    model.add_results([ops.result(flat)])
    static = PassManager(parse_pipeline("static-shape{kind=prefill,prompt=64}"), use_env=False).run(model).model
    port = next(p for p in static.outputs if "flat_ids" in p.get_names())
    assert list(port.get_shape()) == [64]


# -- pin-rows ---------------------------------------------------------------------------------
FIRST = "lift-state,static-shape{kind=prefill,prompt=32,rows=dynamic},kv-io,lower-kvcache"


def test_kv_io_keeps_the_kv_heads_of_an_onnx_first_chunk():
    """An ONNX export reshapes the new keys to [B, L, -1, D]: with L dynamic, inference loses
    the heads that the empty past it removes told it, which the If would have padded to the
    first chunk's rows (every later type was stale, which check mode refused)."""
    model = PassManager(parse_pipeline(FIRST), use_env=False).run(ir.load(fixtures.path("llama", "onnx"))).model
    ports = {p.get_any_name(): str(p.get_partial_shape()) for p in model.outputs}
    assert ports["present.0.key"] == "[1,2,?,16]" and ports["present.1.value"] == "[1,2,?,16]"


def test_pin_rows_sets_the_batch_gpt2s_onnx_logits_lost():
    model = PassManager(parse_pipeline(FIRST.replace("kv-io", "kv-io{slice_logits=true}")),
                        use_env=False).run(ir.load(fixtures.path("gpt2", "onnx"))).model
    logits = next(p for p in model.outputs if p.get_any_name() == "logits")
    assert str(logits.get_partial_shape()) == "[?,1,384]"
    run_ = PassManager(parse_pipeline("pin-rows"), use_env=False).run(model)
    assert run_.model is model and str(logits.get_partial_shape()) == "[1,1,384]"
    assert next(p for p in model.outputs if p.get_any_name() == "present.0.key").get_partial_shape() \
        == ov.PartialShape([1, 4, -1, 16])


def test_pin_rows_leaves_an_ir_first_chunk_as_it_is():
    model = run("llama", FIRST + ",pin-rows")
    assert not any("pin_rows" in op.get_friendly_name() for op in model.get_ordered_ops())


def test_pin_rows_refuses_an_output_with_two_dimensions_that_follow_the_rows():
    from kvc.passes.framework.invariants import check
    from kvc.passes.pin_rows import PinRows

    ids = ops.parameter([1, -1], np.float32, name="input_ids")
    rows = ops.reshape(ids, ops.constant(np.array([-1, 1], np.int64)), False)
    square = ops.matmul(rows, ids, False, False)  # [?, ?]
    model = ov.Model([square], [ids])
    name, reason = check(("outputs-but-rows",), model)  # what pin-rows ensures, broken here
    assert name == "outputs-but-rows" and "is dynamic (shape [?,?]) beyond its rows; run pin-rows" in reason
    with pytest.raises(PassFailure, match=r"2 of its dimensions follow the rows \(\[1, 1\] with one row, \[2, 2\]"):
        PassManager([PinRows()], use_env=False).run(model)


@pytest.mark.parametrize("form", ["add", "range"])
def test_slot_positions_feed_rotary_positions_and_keep_causal_comparisons(form):
    """`cache_position` (a model without position_ids): `arange(q) + past_len` or
    `arange(past_len, past_len + q)`. Where it enters a positional encoding (converted to
    f32 for the rotary MatMul, or indexing a cos/sin table) it becomes the token positions,
    cumsum(mask)[-q:] - 1; its comparison with the key slots (causal: slot order is position
    order) keeps the slots, though the two share an Unsqueeze (the review's graph: with the
    shared node rewired whole, the causal mask compared positions with slots)."""
    import openvino as ov
    import openvino.opset13 as ops

    from kvc.runtime.session import NumpySession

    ids = ops.parameter([1, 4], np.int64, name="input_ids")
    mask = ops.parameter([1, 8], np.int64, name="attention_mask")
    past = ops.parameter([1, 1, 4, 2], np.float32, name="past_key_values.0.key")
    for p in (ids, mask, past):
        p.output(0).set_names({p.get_friendly_name()})
    i64 = lambda v: ops.constant(np.array(v, np.int64))  # noqa: E731
    past_len = ops.gather(ops.shape_of(past), i64(2), i64(0))
    steps = ops.gather(ops.shape_of(ids), i64(1), i64(0))
    cache_position = (ops.add(ops.range(i64(0), steps, i64(1), output_type="i64"), past_len) if form == "add"
                      else ops.range(past_len, ops.add(past_len, steps), i64(1), output_type="i64"))
    shared = ops.unsqueeze(cache_position, i64(1))  # [4, 1]
    rotary = ops.matmul(ops.convert(shared, "f32"), ops.constant(np.ones((1, 1), np.float32)), False, False)
    table = ops.gather(ops.constant(np.arange(16, dtype=np.float32) * 10), cache_position, i64(0))  # cos/sin-like
    causal = ops.less_equal(ops.range(i64(0), i64(8), i64(1), output_type="i64"), shared)
    for node, name in ((rotary, "rotary"), (table, "table"), (causal, "causal")):
        node.output(0).set_names({name})
    model = ov.Model([rotary, table, causal, ops.reduce_sum(past, i64([0, 1, 2, 3]))], [ids, mask, past])
    record = PassManager(parse_pipeline("mask-positions"), use_env=False).run(model)
    assert record.records[0].rule_hits == {"mask-positions/slot-positions": 1}
    out = NumpySession(record.model).infer({
        "input_ids": np.ones((1, 4), np.int64), "past_key_values.0.key": np.zeros((1, 1, 4, 2), np.float32),
        "attention_mask": np.array([[1, 1, 0, 0, 0, 1, 1, 1]])})  # two past tokens, a pad row, three new
    assert out["rotary"].reshape(-1).tolist() == [1.0, 2.0, 3.0, 4.0]  # the pad row's position is any
    assert out["table"].tolist() == [10.0, 20.0, 30.0, 40.0]
    assert out["causal"].sum(axis=1).tolist() == [5, 6, 7, 8]  # still slots 4..7


def test_a_window_written_as_a_difference_of_slots_measures_positions_and_the_causal_triu_keeps_its_diagonal():
    """Gemma 3's language model as optimum-intel patches it: `q_idx = arange(q) + past_len` (the
    past's length from the shapes), `beyond = (q_idx - kv_idx) >= W` over cache slots, beside a
    causal triu whose diagonal (past + 1) is folded into its own arange. `index-compare` gives
    the difference the positions (the window then counts tokens, not slots) and leaves the
    causal comparison on slots: rewritten too, it lost its diagonal and masked each token itself."""
    import openvino as ov
    import openvino.opset13 as ops

    from kvc.runtime.session import NumpySession

    ids = ops.parameter([1, 1], np.int64, name="input_ids")
    mask = ops.parameter([1, 8], np.int64, name="attention_mask")
    pos = ops.parameter([1, 1], np.int64, name="position_ids")
    for p in (ids, mask, pos):
        p.output(0).set_names({p.get_friendly_name()})
    i64 = lambda v: ops.constant(np.array(v, np.int64))  # noqa: E731
    kv_len = ops.gather(ops.shape_of(mask), i64(1), i64(0))
    steps = ops.gather(ops.shape_of(ids), i64(1), i64(0))
    past_len = ops.subtract(kv_len, steps)
    q_idx = ops.add(ops.unsqueeze(ops.range(i64(0), steps, i64(1), output_type="i64"), i64(1)), past_len)  # [1, 1]
    kv_idx = ops.unsqueeze(ops.range(i64(0), kv_len, i64(1), output_type="i64"), i64(0))  # [1, 8]
    beyond = ops.greater_equal(ops.subtract(q_idx, kv_idx), i64([[3]]))  # window 3
    diagonal = ops.add(past_len, i64(1))
    triu = ops.greater_equal(kv_idx, ops.unsqueeze(ops.range(diagonal, ops.add(diagonal, steps), i64(1),
                                                             output_type="i64"), i64(1)))  # key after the query
    for node, name in ((beyond, "beyond"), (triu, "triu")):
        node.output(0).set_names({name})
    model = ov.Model([beyond, triu], [ids, mask, pos])
    record = PassManager(parse_pipeline("mask-positions"), use_env=False).run(model)
    assert record.records[0].rule_hits == {"mask-positions/index-compare": 2}  # both seen, one windowed
    # four past tokens left-aligned in slots 0..3, free slots 4..6, the new token (position 4) in slot 7
    out = NumpySession(record.model).infer({"input_ids": np.ones((1, 1), np.int64), "position_ids": np.array([[4]]),
                                            "attention_mask": np.array([[1, 1, 1, 1, 0, 0, 0, 1]])})
    assert out["beyond"].reshape(-1).tolist() == [True, True, False, False, False, False, False, False]  # 4 - p >= 3
    assert out["triu"].reshape(-1).tolist() == [False] * 8  # no slot after the newest
