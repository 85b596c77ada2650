"""The far past compile's far probes start over (kvc.runtime.generate.far_past): the same values
in the source model's cache and in a static cache of any float type and layout, attended."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from kvc import fixtures
from kvc.errors import UsageError
from kvc.export.compile import compile_static
from kvc.ir import load
from kvc.plan import KVSpec
from kvc.runtime.generate import far_past, far_past_fits, greedy
from kvc.runtime.session import NumpySession, OpenVINOSession
from kvc.runtime.static_pipeline import StaticPipeline
from kvc.verify.compiled import probe_cases


def test_a_far_past_is_exact_in_every_float_cache_and_the_same_in_any_layout():
    rows = far_past("past_key_values.3.value", (1, 2, 40, 8), 2)
    assert rows.dtype == np.float32 and rows.shape == (1, 2, 40, 8)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        np.testing.assert_array_equal(rows.astype(dtype).astype(np.float32), rows)
    # values stored [B, H, D, S] hold the same numbers at the same rows
    np.testing.assert_array_equal(far_past("past_key_values.3.value", (1, 2, 8, 40), 3), np.swapaxes(rows, 2, 3))
    # a shorter past is the longer one's first rows; each tensor has its own; every row differs
    np.testing.assert_array_equal(far_past("past_key_values.3.value", (1, 2, 10, 8), 2), rows[:, :, :10])
    assert not np.array_equal(far_past("past_key_values.3.key", (1, 2, 40, 8), 2), rows)
    flat = rows[0].transpose(1, 0, 2).reshape(40, -1)
    assert len({r.tobytes() for r in flat}) == 40


@pytest.mark.parametrize("stateless", [False, True])
def test_the_source_model_is_given_the_far_past_on_any_engine(stateless):
    """OpenVINO's variables, kvc's interpreter's, and a lifted model's past inputs all start
    with the far past: the runs agree, differ from a run over empty rows, and keep only the
    prompt's rows and on in their cache."""
    model = load(fixtures.path("llama"))
    if stateless:
        from kvc.passes.framework.registry import get_pass

        model = get_pass("lift-state").run(model).model
    runs = [greedy(session, [5, 6, 7], 3, origin=40, filled=True, keep_cache=True)
            for session in (NumpySession(model), OpenVINOSession(model))]
    assert runs[0].tokens == runs[1].tokens
    np.testing.assert_allclose(runs[0].logits[-1], runs[1].logits[-1], atol=1e-4)
    assert all(v.shape[2] == 5 for v in runs[0].cache.values())  # 3 prompt rows, 2 generated
    empty = greedy(OpenVINOSession(model), [5, 6, 7], 3, origin=40)
    assert np.abs(empty.logits[0] - runs[1].logits[0]).max() > 0.1


@pytest.mark.parametrize("stateless", [False, True])
def test_a_prompt_from_a_position_runs_over_that_many_masked_rows_as_a_static_model_does(stateless, monkeypatch):
    """Without a far past, a source with position_ids runs a prompt from position P over P
    masked rows of zeros, as a static model runs it over P empty, masked slots: transformers 4's
    PhiMoE sizes its cos/sin table by its cache and indexes it by position, and over no past
    read Gather's zeros for position 112 (a compile published right was refused). Masked rows
    change nothing else: the same tokens and logits as over no past, and the cache it keeps
    holds the prompt's rows and on. A model without position_ids counts positions from its
    first attended row, so it still runs over no past."""
    model = load(fixtures.path("llama"))
    if stateless:
        from kvc.passes.framework.registry import get_pass

        model = get_pass("lift-state").run(model).model
    session, feeds = OpenVINOSession(model), []
    infer = session.infer
    monkeypatch.setattr(session, "infer", lambda feed: feeds.append(dict(feed)) or infer(feed))
    run = greedy(session, [5, 6, 7], 3, origin=40, keep_cache=True)
    assert feeds[0]["attention_mask"].tolist() == [[0] * 40 + [1] * 3]
    assert feeds[1]["attention_mask"].tolist() == [[0] * 40 + [1] * 4]
    assert feeds[0]["position_ids"].tolist() == [[40, 41, 42]]
    assert all(v.shape[2] == 5 for v in run.cache.values())  # 3 prompt rows, 2 generated
    monkeypatch.undo()
    unmasked = OpenVINOSession(model)
    feed = {"input_ids": np.array([[5, 6, 7]]), "attention_mask": np.ones((1, 3), np.int64),
            "position_ids": np.array([[40, 41, 42]]), "beam_idx": np.zeros(1, np.int32)}
    if stateless:
        from kvc.runtime.generate import empty_past

        feed.update(empty_past(unmasked, 1))
    np.testing.assert_allclose(run.first_logits, unmasked.infer(feed)["logits"][0], atol=1e-5)
    bloom = OpenVINOSession(load(fixtures.path("bloom")))
    assert not bloom.has_input("position_ids")
    seen = []
    bloom_infer = bloom.infer
    monkeypatch.setattr(bloom, "infer", lambda feed: seen.append(dict(feed)) or bloom_infer(feed))
    greedy(bloom, [5, 6, 7], 1, origin=40)
    assert seen[0]["attention_mask"].tolist() == [[1, 1, 1]]


def test_a_far_past_needs_an_empty_cache_and_a_float_static_cache():
    session = OpenVINOSession(load(fixtures.path("llama")))
    with pytest.raises(UsageError, match="needs reset"):
        greedy(session, [5], 1, origin=8, filled=True, reset=False)
    pipe = StaticPipeline.__new__(StaticPipeline)
    pipe.kv = [KVSpec("past_key_values.0.key", "present.0.key", 0, "key", 2, "i8", (1, 2, 64, 16)),
               KVSpec("past_key_values.0.key_scale", "present.0.key_scale", 0, "key_scale", 2, "f16", (1, 2, 64, 1))]
    with pytest.raises(UsageError, match=r"a far past needs a float cache \(f32, f16 or bf16\), not \['i8'\]"):
        pipe.fill_far_past(8)


def test_far_probes_start_over_a_far_past_unless_the_cache_is_int8():
    # the chunks of bf16 CPU blobs (16, first chunks of 16, static rows) on any host
    lengths = compile_static(("CPU",), "bf16", max_prompt_len=64, min_response_len=64).lengths()
    for kv_types, filled in ((["f16"], True), (["bf16"], True), (["f32"], True), (["i8", "f16"], False)):
        cases = probe_cases(lengths, 300, filled=far_past_fits(kv_types))
        ends = [(p, p.origin + len(p.prompt) == lengths.prompt) for p in cases if p.origin and not p.decode]
        assert any(far for _, far in ends) and all(p.filled == filled for p, far in ends if far)
        # the pad probes (a chunk model's fewest tokens, ending before P) run over empty rows
        assert any(not far for _, far in ends) and not any(p.filled for p, far in ends if not far)
        # a generate variant's over empty rows, where its last steps read only what they wrote, and over a far past
        decodes = [p.filled for p in cases if p.decode]
        assert decodes == ([False, True] if filled else [False])
        assert not any(p.filled for p in cases if not p.origin)
