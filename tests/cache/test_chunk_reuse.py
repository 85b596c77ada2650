"""Chunk-level reuse (issue 16 part 2): rows moved to new positions are the rows computed
there wherever they cannot depend on context, a repair covering the block is exact, seams
are where stored blocks stop being contiguous, approximate rows never reach a chained key,
and models whose keys cannot be moved are refused."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.cache.chunks import ChunkReuse
from kvc.cache.moves import ChunkReuseRefused, calibrate, candidates, inverse_frequencies, model_config
from kvc.cache.prefix import PrefixCache
from kvc.cache.serving import CachedPipeline
from kvc.errors import UsageError
from kvc.export.build import build_static
from kvc.plan import StaticOptions
from kvc.runtime.session import NumpySession, OpenVINOSession, NPUW_CPU_CONFIG
from kvc.runtime.static_pipeline import StaticPipeline
from tests.cli.runner import kvc
from tests.conftest import COMPRESSED_FORMATS, SAMPLE, fixture_names

P, C, R = 128, 16, 32
MOVABLE = [n for n in fixture_names(compressed=True)
           if n.split("_int")[0] not in ("gpt2", "gpt_bigcode", "gpt_neo", "opt", "xglm", "bloom", "mpt",
                                         "falcon_alibi", "gpt_neox_japanese", "phi3_longrope")]


@functools.cache
def static_models(name: str, kv: str = "f32"):
    options = StaticOptions(max_prompt_len=P, min_response_len=R, prefill_chunk_size=C, kv_precision=kv)
    return build_static(ir.load(fixtures.path(name)), options, use_env=False)


def pipeline(name: str, backend: str = "numpy", kv: str = "f32") -> StaticPipeline:
    sm = static_models(name, kv)
    make = {"numpy": NumpySession, "openvino": OpenVINOSession,
            "npu": lambda m: OpenVINOSession(m, "NPU", NPUW_CPU_CONFIG)}[backend]
    return StaticPipeline(make(sm.models["prefill"]), {s: make(sm.models[n]) for s, n in sm.generate_names.items()},
                          sm.plan, vocab=384)


def served(name: str, backend: str = "numpy", repair: int | None = None, config: dict | None = None):
    pipe = pipeline(name, backend)
    mover = calibrate(pipe, model_config(fixtures.path(name)) if config is None else config)
    return CachedPipeline(pipe, PrefixCache(block_size=C), ChunkReuse(mover, repair))


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 384, n).tolist()


DOC = tokens(1, 2 * C)  # a two-block document
FIRST = DOC + tokens(2, 3)  # the document at position 0
MOVED = tokens(3, C) + DOC + tokens(4, 3)  # after other text: moved by one block


@pytest.mark.parametrize("name, backend", [(n, "numpy") for n in MOVABLE]
                         + [(n, "openvino") for n in MOVABLE if n in SAMPLE + COMPRESSED_FORMATS])
def test_moved_rows_equal_the_rows_computed_there_where_context_cannot_matter(name, backend):
    """Layer 0's keys and values depend on the token and its position only: moved (keys
    re-rotated by the position delta), they must be the rows a full prefill computes at the
    new position. A wrong rotation (sign, pairing, frequency or delta) fails this."""
    pipe = served(name, backend, repair=0)
    pipe.generate(FIRST, 1)
    got = pipe.generate(MOVED, 1)
    assert got.placed_tokens == 2 * C and got.cached_tokens == 0
    plain = pipeline(name, backend)
    plain.generate(MOVED, 1)
    doc = slice(C, 3 * C)
    for spec in pipe.pipeline.kv:
        if spec.layer != 0:
            continue
        ours = np.moveaxis(pipe.pipeline.buffers[spec.input], spec.seq_axis, 0)[doc].astype(np.float64)
        want = np.moveaxis(plain.buffers[spec.input], spec.seq_axis, 0)[doc].astype(np.float64)
        err = np.abs(ours - want).max() / (np.abs(want).max() or 1.0)
        assert err < 1e-5, f"{spec.input}: moved rows differ from the rows computed there by {err:.2g} (relative)"
    deep = [s for s in pipe.pipeline.kv if s.layer == max(t.layer for t in pipe.pipeline.kv)]
    assert any(not np.allclose(pipe.pipeline.buffers[s.input], plain.buffers[s.input]) for s in deep), \
        "the last layer's rows equal the full prefill's: nothing was reused"


@pytest.mark.parametrize("backend", ["numpy", "openvino", "npu"])
@pytest.mark.parametrize("name", ["llama", "phi", "gptj", "smollm3", "gpt_oss"])
def test_a_repair_covering_the_reused_text_is_exact(name, backend):
    pipe = served(name, backend, repair=len(DOC))
    pipe.generate(FIRST, 2)
    got = pipe.generate(MOVED, 3)
    plain = pipeline(name, backend).generate(MOVED, 3)
    assert got.placed_tokens == 0
    assert got.tokens == plain.tokens
    for ours, theirs in zip(got.logits, plain.logits):
        assert np.array_equal(ours, theirs)


def test_a_seam_is_repaired_once_and_contiguous_blocks_follow_it():
    """A three-block document reused after other text: one seam (its first block), the first
    R tokens recomputed, the rest placed; the first-step logits stay close to the full
    prefill's, and the request says how many tokens are approximate."""
    doc = tokens(5, 3 * C)
    pipe = served("llama", repair=4)
    pipe.generate(tokens(6, C) + doc + [7, 8], 1)
    prompt = tokens(7, 2 * C) + doc + [9, 10]
    got = pipe.generate(prompt, 4)
    assert got.placed_tokens == 3 * C - 4
    assert got.metrics()["approximate_tokens"] == 3 * C - 4
    plain = pipeline("llama").generate(prompt, 4)
    a, b = got.logits[0], plain.logits[0]
    cosine = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    assert 0.9 < cosine < 1 - 1e-9, cosine  # close, and not the exact answer


def test_approximate_rows_are_never_stored_under_a_chained_key():
    """After a request that placed rows, the same prompt without chunk reuse hits only the
    blocks computed before the first placed one, and its output is the uncached one."""
    pipe = served("llama", repair=0)
    pipe.generate(FIRST, 1)
    pipe.generate(MOVED, 1)
    exact_only = CachedPipeline(pipe.pipeline, pipe.cache)
    again = exact_only.generate(MOVED, 3)
    plain = pipeline("llama").generate(MOVED, 3)
    assert again.cached_tokens == C  # the first block (computed), not the document's
    assert [np.array_equal(a, b) for a, b in zip(again.logits, plain.logits)] == [True] * 3


def test_a_session_turn_over_placed_rows_counts_them_and_stores_none_under_a_chained_key():
    """A chat session keeps the rows of its last turn, placed ones too: the next turn restored
    them and reported 0 approximate tokens, and stored them under chained keys, where a later
    request without a session hit them (cached 48, approximate 0, other tokens than its
    uncached run)."""
    pipe = served("llama", repair=0)
    pipe.generate(FIRST, 1)
    pipe.start_chat("s")
    history = tokens(3, C) + DOC + tokens(4, 3)
    turn1 = pipe.generate(history, 2, session="s")
    assert turn1.placed_tokens == 2 * C
    turn2 = pipe.generate(history + turn1.tokens[:1] + [5, 6, 7], 2, session="s")
    assert turn2.cached_tokens > 2 * C and turn2.placed_tokens >= 2 * C  # the placed rows it restored count
    plain = history + turn1.tokens[:1] + [5, 6, 7, 8]
    exact_only = CachedPipeline(pipe.pipeline, pipe.cache)
    again, alone = exact_only.generate(plain, 3), pipeline("llama").generate(plain, 3)
    assert again.cached_tokens == C and again.placed_tokens == 0  # the first block alone is exact
    assert [np.array_equal(a, b) for a, b in zip(again.logits, alone.logits)] == [True] * 3


def test_exact_blocks_serve_a_turn_whose_session_rows_were_placed():
    """A session's first turn placed D1 D2 (approximate); a request without chunk reuse then
    stored D1 D2 exactly. The next turn, edited right after them, restored the session's 32
    placed rows (approximate 32, other logits than its uncached run) although the cache held
    the same 32 rows exact. Now the cache serves it: approximate 0, the uncached logits."""
    d1, d2 = tokens(20, C), tokens(21, C)
    pipe = served("llama", repair=0)
    pipe.generate(tokens(22, C) + d1 + d2 + [1, 2, 3], 1)
    pipe.start_chat("s")
    assert pipe.generate(d1 + d2 + [4, 5, 6], 2, session="s").placed_tokens == 2 * C
    CachedPipeline(pipe.pipeline, pipe.cache).generate(d1 + d2 + [7, 8, 9], 1)  # computed: exact D1 D2
    history = d1 + d2 + [9, 9, 9, 9]
    got, alone = pipe.generate(history, 3, session="s"), pipeline("llama").generate(history, 3)
    assert (got.cached_tokens, got.placed_tokens) == (2 * C, 0)  # placed was 32
    assert [np.array_equal(a, b) for a, b in zip(got.logits, alone.logits)] == [True] * 3


def test_chunk_reuse_blocks_are_no_events_and_never_evict_the_requests_own_blocks():
    """A chunk-reuse block was a `stored` event without a parent (a first block, to a consumer
    of TensorRT-LLM's stream) under a key that is no chain's, and storing it evicted the block
    the same request had just stored."""
    mover = calibrate(pipeline("llama"), model_config(fixtures.path("llama")))
    pipe = CachedPipeline(pipeline("llama"), PrefixCache(block_size=C, max_blocks=3, event_buffer_size=100),
                          ChunkReuse(mover, 0))
    pipe.generate(FIRST, 1)
    events = [e.to_dict() for e in pipe.cache.get_latest_events()]
    first = tokens(10, C)
    pipe.generate(first + DOC + tokens(8, 2 * C) + [1], 1)  # DOC placed, two blocks computed after it
    events += [e.to_dict() for e in pipe.cache.get_latest_events()]
    own = pipe.cache.lookup(first + [0], C)
    assert len(own) == 1 and own[0].exact  # its own first block stayed
    chained = {k for k, b in pipe.cache.blocks.items() if b.exact}
    replayed = set()
    for e in events:
        if e["type"] == "stored":
            replayed |= {b["block_hash"] for b in e["blocks"]}
        elif e["type"] == "removed":
            replayed -= set(e["block_hashes"])
    assert replayed == chained and any(not b.exact for b in pipe.cache.blocks.values())


def test_blocks_computed_after_placed_rows_are_reusable_as_chunks():
    """A new document that first appears after a reused one is stored for chunk reuse, so
    the next prompt with it reuses it."""
    other = tokens(8, 2 * C)
    pipe = served("llama", repair=0)
    pipe.generate(FIRST, 1)
    first = pipe.generate(tokens(10, C) + DOC + other + [1], 1)  # DOC placed, then `other` computed after it
    assert first.placed_tokens == 2 * C
    approximate = [b for b in pipe.cache.blocks.values() if not b.exact]
    assert len(approximate) == 2 and all(b.parent is None for b in approximate)
    second = pipe.generate(tokens(9, C) + other + [2], 1)
    assert second.placed_tokens == 2 * C


@pytest.mark.parametrize("name,message", [
    ("gpt2", "values change when the whole chunk moves"),
    ("opt", "absolute positions"),
    ("bloom", "no position_ids input"),
    ("mpt", "no position_ids input"),
    ("gpt_neox_japanese", "no position_ids input"),
    # LongRoPE: a call whose positions pass 64 rotates every row at the long factors, so a chunk
    # moved past 64 is not the chunk rotated; said so, where the calibration had said its values
    # "change when the whole chunk moves: the model mixes absolute positions"
    ("phi3_longrope", "rotary is LongRoPE"),
])
def test_models_whose_rows_cannot_move_are_refused(name, message):
    with pytest.raises(ChunkReuseRefused, match=message):
        calibrate(pipeline(name), model_config(fixtures.path(name)))


@pytest.mark.parametrize("change,message", [
    ({"rope_parameters": {"rope_theta": 11000.0, "rope_type": "default"}}, "match no rotation"),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"rope_parameters": {"rope_theta": "ten thousand"}}, "cannot read"),
])
def test_a_config_that_does_not_explain_the_keys_is_refused(change, message):
    """kvc checks its reading of config.json against the model: a theta 10% off is refused."""
    config = {**model_config(fixtures.path("llama")), **change}
    with pytest.raises(ChunkReuseRefused, match=message):
        calibrate(pipeline("llama"), config)


def test_llama3_rope_scaling_is_read_and_checked():
    """llama3_rope's keys move at Llama 3.1's scaled frequencies (one kept, two blended, five
    divided by 8, as transformers computes them); read as the unscaled rope they are refused."""
    config = model_config(fixtures.path("llama3_rope"))
    freqs = np.array(inverse_frequencies(config, 16))
    base = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(freqs / base, [1, 0.772812, 0.130423, 0.125, 0.125, 0.125, 0.125, 0.125], rtol=1e-5)
    calibrate(pipeline("llama3_rope"), config)
    unscaled = {**config, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    with pytest.raises(ChunkReuseRefused, match="match no rotation"):
        calibrate(pipeline("llama3_rope"), unscaled)


def test_without_a_config_only_unrotated_keys_move():
    with pytest.raises(ChunkReuseRefused, match="no config.json"):
        calibrate(pipeline("llama"), None)


def test_int8_kv_is_refused():
    with pytest.raises(ChunkReuseRefused, match="int8 KV"):
        calibrate(pipeline("llama", kv="i8"), model_config(fixtures.path("llama")))


def test_candidates_read_partial_and_interleaved_rotary():
    config = model_config(fixtures.path("gptj"))
    dims = {(r.dim, r.interleaved) for r in candidates(config, 16)}
    assert (8, True) in dims and (16, False) in dims


def test_chunk_reuse_needs_the_prefix_cache():
    pipe = pipeline("llama")
    mover = calibrate(pipe, model_config(fixtures.path("llama")))
    with pytest.raises(Exception, match="enable prefix caching"):
        CachedPipeline(pipe, None, ChunkReuse(mover))
    with pytest.raises(Exception, match="repair must be"):
        ChunkReuse(mover, -1)


def test_kvc_run_reports_approximate_tokens(tmp_path):
    out = tmp_path / "out"
    kvc("compile", fixtures.path("llama"), "-o", out, "--max-prompt-len", str(P), "--min-response-len", str(R),
        "--prefill-chunk-size", str(C), "--no-verify")
    requests = tmp_path / "r.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "prompt_ids": p, "max_new_tokens": 2}) + "\n"
                                for i, p in enumerate([FIRST, MOVED])))
    data = json.loads(kvc("run", out, "--requests", requests, "--prefix-cache", "--chunk-reuse", "--chunk-repair",
                          "4", "--json").stdout)
    assert [r["approximate_tokens"] for r in data["requests"]] == [0, 2 * C - 4]
    text = kvc("run", out, "--requests", requests, "--prefix-cache", "--chunk-reuse").output
    assert "approx" in text and f"chunk reuse: {2 * C - 16} prompt tokens placed" in text
    assert "needs --prefix-cache" in kvc("run", out, "--requests", requests, "--chunk-reuse", code=2).output
    # the summary's blocks are the chained ones, the set the events replay to; chunk-reuse blocks (no events)
    # apart: "blocks", "stored_blocks" and "evicted_blocks" counted them, and a replay did not match
    after = tmp_path / "after.jsonl"
    after.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": 1}) + "\n"
                             for p in [FIRST, tokens(10, C) + DOC + tokens(8, 2 * C) + [1]]))
    events = tmp_path / "events.jsonl"
    cache = json.loads(kvc("run", out, "--requests", after, "--prefix-cache", "--chunk-reuse", "--chunk-repair", "0",
                           "--events", events, "--json").stdout)["cache"]
    stored = [json.loads(line) for line in events.read_text().splitlines()]
    replayed = {b["block_hash"] for e in stored if e["type"] == "stored" for b in e["blocks"]}
    assert replayed == set(cache["blocks"]) and len(cache["blocks"]) == cache["stored_blocks"] == 3
    assert len(cache["chunk_blocks"]) == cache["chunk_stored_blocks"] == 2 and not replayed & set(cache["chunk_blocks"])
    text = kvc("run", out, "--requests", after, "--prefix-cache", "--chunk-reuse", "--chunk-repair", "0").output
    assert "prefix cache: 3 blocks, " in text and "(and 2 chunk-reuse blocks, 0 evicted)" in text
    assert "go with --requests" in kvc("run", out, "--prompt-ids", "1,2", "--chunk-reuse", code=2).output


def test_placed_rows_must_follow_each_other_and_leave_the_last_token():
    pipe = pipeline("llama")
    rows = pipe.copy_rows(0, 8)
    prompt = tokens(11, 40)
    for placed in [((4, rows), (8, rows)),  # the second overlaps the first
                   ((32, rows),),  # covers the last prompt token (39)
                   ((2, rows),)]:  # before the restored rows end
        with pytest.raises(UsageError, match="placed KV rows"):
            pipe.prefill_prompt(prompt, 1, reuse=C if placed[0][0] == 2 else 0, placed=placed)
