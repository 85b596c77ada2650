"""Prefix caching and chat sessions give the tokens the pipeline gives without them.

Every fixture on kvc's numpy interpreter and OpenVINO CPU, and one of each attention kind on the
NPU plugin (its CPU backend), replays one workload with a three-block cache: the hits it must produce are a
hit after part of a chain was evicted, a hit that ends exactly at a chunk boundary, and a hit
on a whole cached prompt (which restores all but the last block: the last token is computed).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kvc import fixtures
from kvc.cache.prefix import PrefixCache
from kvc.cache.serving import CachedPipeline
from kvc.errors import UsageError
from kvc.runtime.static_pipeline import PromptTooLongError
from tests.conftest import COMPRESSED_FORMATS, SAMPLE, fixture_names
from tests.runtime.test_static_pipeline import C, pipeline

NEW = 3


@functools.cache
def workload():
    rng = np.random.default_rng(15)
    a = list(rng.integers(1, 384, 3 * C))  # three blocks
    b = list(rng.integers(1, 384, 2 * C + 8))  # two blocks
    return [
        ("a: stores 3 blocks", a, 0),
        ("b: evicts a's last two (leaves first)", b, 0),
        ("a again: hit after eviction of part of the chain", a, C),
        ("a[:2C] + new: hit ending at a chunk boundary", a[:2 * C] + list(rng.integers(1, 384, 5)), 2 * C),
        ("a[:2C]: the whole prompt cached", a[:2 * C], C),
    ]


@functools.cache
def plain_runs(name: str, backend: str):
    pipe = pipeline(name, "chunked", backend)
    return [pipe.generate(prompt, NEW) for _, prompt, _ in workload()]


# Every architecture and compressed weight format on kvc's runtime; on OpenVINO CPU and the NPU
# plugin (whose sessions take and give the same KV tensors whatever the model) the SAMPLE, one of
# each attention kind, and on OpenVINO CPU one fixture per compressed weight format.
@pytest.mark.parametrize("name, backend", [(n, "numpy") for n in fixture_names(compressed=True)]
                         + [(n, "openvino") for n in SAMPLE + COMPRESSED_FORMATS] + [(n, "npu") for n in SAMPLE])
def test_prefix_cache_gives_the_tokens_of_no_cache(name, backend):
    """The restored blocks were computed by the same chunks a run without the cache computes,
    so the logits are not merely close: they are the same numbers."""
    expected = plain_runs(name, backend)
    cache = PrefixCache(block_size=C, max_blocks=3)
    served = CachedPipeline(pipeline(name, "chunked", backend), cache)
    for (what, prompt, hit), plain in zip(workload(), expected):
        got = served.generate(prompt, NEW)
        assert got.cached_tokens == hit, f"{what}: restored {got.cached_tokens} tokens, expected {hit}"
        assert got.tokens == plain.tokens, f"{what}: {got.tokens} with the cache, {plain.tokens} without"
        for step, (ours, theirs) in enumerate(zip(got.logits, plain.logits)):
            assert np.array_equal(ours, theirs), f"{what}: step {step} logits differ by {np.abs(ours - theirs).max()}"
    assert len(cache.blocks) == 3 and cache.stats.evicted_blocks > 0


@pytest.mark.parametrize("backend", ["numpy", "openvino"])
def test_prefix_cache_over_bulk_chunks_gives_the_tokens_of_no_cache(backend):
    """With a bulk chunk the calls after a restored prefix may split the rest otherwise than a
    run from 0: the tokens are the same and the logits agree to rounding."""
    pipe = pipeline("llama", "bulk", backend)
    plain = [pipe.generate(prompt, NEW) for _, prompt, _ in workload()]
    served = CachedPipeline(pipeline("llama", "bulk", backend), PrefixCache(block_size=C, max_blocks=3))
    for (what, prompt, hit), expected in zip(workload(), plain):
        got = served.generate(prompt, NEW)
        assert got.cached_tokens == hit and got.tokens == expected.tokens, what
        np.testing.assert_allclose(np.array(got.logits), np.array(expected.logits), atol=2e-3, err_msg=what)


@pytest.mark.parametrize("backend", ["openvino"])
@pytest.mark.parametrize("name", SAMPLE + COMPRESSED_FORMATS)
def test_chat_session_gives_the_tokens_of_a_whole_prefill(name, backend):
    """Turns prefill only what follows the stored history; an edited earlier turn rolls the
    cache back to where it diverges. Each turn's tokens equal a fresh prefill of the history."""
    pipe = pipeline(name, "chunked", backend)
    served = CachedPipeline(pipe)
    rng = np.random.default_rng(2)
    served.start_chat("s")
    history = list(rng.integers(1, 384, 7))
    for turn in range(3):
        got = served.generate(history, NEW, session="s")
        assert got.tokens == pipe.generate(history, NEW).tokens, f"turn {turn}"
        assert got.cached_tokens == (0 if turn == 0 else previous)
        previous = len(history) + NEW - 1  # the history and every generated token but the last
        history = history + got.tokens + list(rng.integers(1, 384, 6))
    edited = history[:4] + [history[4] % 383 + 1] + history[5:]  # an earlier turn changed
    got = served.generate(edited, NEW, session="s")
    assert got.cached_tokens == 4 and got.tokens == pipe.generate(edited, NEW).tokens
    served.finish_chat("s")
    with pytest.raises(UsageError, match="no chat session 's'"):
        served.generate(history, NEW, session="s")


def test_chat_session_on_numpy_and_npu():
    for backend in ("numpy", "npu"):
        pipe = pipeline("llama", "chunked", backend)
        served = CachedPipeline(pipe)
        served.start_chat("s")
        first = list(range(3, 20))
        got = served.generate(first, NEW, session="s")
        second = first + got.tokens + [5, 6, 7]
        again = served.generate(second, NEW, session="s")
        assert again.cached_tokens == len(first) + NEW - 1
        assert again.tokens == pipe.generate(second, NEW).tokens, backend


def test_a_session_that_outgrows_the_prefill_is_an_error_with_the_numbers():
    served = CachedPipeline(pipeline("llama", "chunked", "openvino"))
    served.start_chat("long")
    with pytest.raises(PromptTooLongError, match=r"chat session 'long': the history of 65 tokens .*at most 64"):
        served.generate(list(range(1, 66)), NEW, session="long")
    with pytest.raises(UsageError, match="already open"):
        served.start_chat("long")
    with pytest.raises(UsageError, match="no chat session 'other'"):
        served.finish_chat("other")


def test_prefix_caching_refuses_an_unchunked_prefill_and_odd_blocks():
    with pytest.raises(UsageError, match="needs a chunked prefill"):
        CachedPipeline(pipeline("llama", "whole", "numpy"), PrefixCache(block_size=16))
    with pytest.raises(UsageError, match="block size 24 must be a multiple of the prefill chunk size 16"):
        CachedPipeline(pipeline("llama", "chunked", "numpy"), PrefixCache(block_size=24))


def test_larger_blocks_than_the_chunk_restore_whole_blocks():
    pipe = pipeline("llama", "chunked", "openvino")
    served = CachedPipeline(pipe, PrefixCache(block_size=2 * C))
    prompt = list(range(1, 3 * C + 3))
    served.generate(prompt, NEW)
    got = served.generate(prompt[:3 * C] + [9], NEW)
    assert got.cached_tokens == 2 * C and got.tokens == pipe.generate(prompt[:3 * C] + [9], NEW).tokens


def test_a_refused_request_leaves_the_cache_and_sessions_as_they_were():
    from kvc.cache.prefix import Retention, TokenRange

    cache = PrefixCache(block_size=C, max_blocks=8)
    served = CachedPipeline(pipeline("llama", "chunked", "openvino"), cache)
    prompt = list(range(1, 2 * C + 4))
    served.start_chat("s")
    served.generate(prompt, NEW, session="s")
    before = (cache.keys(), cache.stats.to_dict(), list(served.sessions["s"].tokens))
    bad = [
        (dict(retention=Retention((TokenRange(0, 99, 50),))), "outside the 35-token prompt"),
        (dict(session="nope"), "no chat session 'nope'"),
        (dict(session="s", new_tokens=10_000), "exceed the KV capacity"),
    ]
    for kwargs, message in bad:
        new_tokens = kwargs.pop("new_tokens", NEW)
        with pytest.raises(UsageError, match=message):
            served.generate(prompt, new_tokens, **kwargs)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        served.generate(prompt + [-5], NEW, session="s")
    assert (cache.keys(), cache.stats.to_dict(), list(served.sessions["s"].tokens)) == before
    assert served.generate(prompt, NEW, session="s").cached_tokens == 2 * C + 2  # the session still serves


def test_the_prefix_cache_keeps_int8_kv_and_its_scales():
    """Blocks hold every cache tensor the plan lists, int8 rows and their scales alike: a hit
    gives the uncached run's logits bit for bit."""
    import kvc.ir as ir
    from kvc.export.build import build_static
    from kvc.plan import StaticOptions
    from kvc.runtime.session import OpenVINOSession
    from kvc.runtime.static_pipeline import StaticPipeline

    sm = build_static(ir.load(fixtures.path("qwen2")), StaticOptions(64, 32, prefill_chunk_size=C, kv_precision="i8"),
                      use_env=False)
    pipe = StaticPipeline(OpenVINOSession(sm.models["prefill"]),
                          {s: OpenVINOSession(sm.models[n]) for s, n in sm.generate_names.items()}, sm.plan)
    cache = PrefixCache(block_size=C, max_blocks=8)
    served = CachedPipeline(pipe, cache)
    prompt = list(range(5, 5 + 2 * C + 3))
    served.generate(prompt, NEW)
    block = next(iter(cache.blocks.values()))
    assert {str(a.dtype) for a in block.rows.values()} == {"int8", "float16"} and len(block.rows) == len(sm.plan.kv)
    plain = pipe.generate(prompt, NEW)
    got = served.generate(prompt, NEW)
    assert got.cached_tokens == 2 * C and got.tokens == plain.tokens
    assert all(np.array_equal(a, b) for a, b in zip(got.logits, plain.logits))


@pytest.mark.parametrize("prompt, found", [
    ([1.9, 2.7, 3.2], r"found 1.9 \(float\) at position 0"),  # was taken as [1, 2, 3]
    ([5, 6.0], r"found 6.0 \(float\) at position 1"),
    (["5", "6", "7"], r"found '5' \(str\) at position 0"),  # was taken as [5, 6, 7]
    ([True, 2, 3], r"found True \(bool\) at position 0"),  # was taken as [1, 2, 3]
    ([[1, 2], [3, 4]], r"found a nested sequence \(shape \[2, 2\]\)"),  # was flattened
    (np.array([[1, 2, 3]]), r"found a nested sequence \(shape \[1, 3\]\)"),
    (np.array([1.5, 2.5]), r"found 1.5 \(float\) at position 0"),
    ("1 2 3", "found a string"),
    (7, "found a single value"),
])
def test_a_prompt_that_is_not_token_ids_is_refused_not_converted(prompt, found):
    """`CachedPipeline.generate` and `StaticPipeline.generate` took `np.asarray(prompt, int64)`:
    floats were truncated, strings parsed, bools taken as 0 and 1, nested lists flattened. The
    CLI's JSON parser refuses them; the API now does too, before the cache or a session changes."""
    cache = PrefixCache(block_size=C, max_blocks=8)
    served = CachedPipeline(pipeline("llama", "chunked", "numpy"), cache)
    served.start_chat("s")
    for run in (lambda: served.generate(prompt, NEW), lambda: served.generate(prompt, NEW, session="s"),
                lambda: served.pipeline.generate(prompt, NEW)):
        with pytest.raises(UsageError, match="the prompt must be a list of token ids .*" + found):
            run()
    assert cache.keys() == [] and cache.stats.requests == 0 and served.sessions["s"].tokens == []


def test_a_number_of_new_tokens_that_is_not_an_integer_is_refused():
    served = CachedPipeline(pipeline("llama", "chunked", "numpy"), PrefixCache(block_size=C))
    for new_tokens in (2.5, True, "3"):
        with pytest.raises(UsageError, match="the number of new tokens must be an integer, got"):
            served.generate([1, 2, 3], new_tokens)  # 2.5 gave 3 tokens
    assert len(served.generate([1, 2, 3], np.int64(2)).tokens) == 2


def _turn_within_a_chunk(seed: int):
    """Session "s" over llama's chunked pipeline on OpenVINO CPU with a 16-block cache: a turn
    of 3C tokens, then one whose prefix with it ends within a chunk (C + 7). Returns the id
    maker, a plain pipeline, the cache, the served pipeline, the second turn's prompt and run."""
    rng = np.random.default_rng(seed)
    ids = lambda k: [int(t) for t in rng.integers(1, 384, k)]  # noqa: E731
    plain = pipeline("llama", "chunked", "openvino")
    cache = PrefixCache(block_size=C, max_blocks=16)
    served = CachedPipeline(pipeline("llama", "chunked", "openvino"), cache)
    a = ids(3 * C)
    served.start_chat("s")
    served.generate(a, 2, session="s")
    edited = a[:C + 7] + ids(2 * C)
    return ids, plain, cache, served, edited, served.generate(edited, 2, session="s")


def test_a_session_turn_within_a_chunk_stores_no_rows_of_shifted_calls_under_a_chained_key():
    """A turn whose prefix with the session ends within a chunk (here C + 7) computes the rest
    with calls that start there, not where a run from 0 starts them: its rows agree with that
    run to rounding only. They were stored under chained keys, and a later request without a
    session restored them as exact (cached 2C, approximate 0) with other logits than its
    uncached run (OpenVINO CPU f32: 1e-6; bf16: 0.018). Now the chained blocks stop at the chunk
    boundary below the prefix, and the request restores C rows and gives the uncached numbers."""
    ids, plain, cache, served, edited, turn = _turn_within_a_chunk(29)
    assert turn.cached_tokens == C + 7 and turn.tokens == plain.generate(edited, 2).tokens
    assert not any(not b.exact for b in cache.blocks.values())  # no chunk reuse: nothing kept for it
    later = edited[:2 * C] + ids(5)
    got, expected = served.generate(later, NEW), plain.generate(later, NEW)
    assert got.cached_tokens == C and got.placed_tokens == 0  # was 2C: the turn's shifted rows
    assert [np.array_equal(x, y) for x, y in zip(got.logits, expected.logits)] == [True] * NEW
    assert served.sessions["s"].chained == C  # the session's rows from C on are the turn's shifted calls'


def test_exact_blocks_serve_a_turn_where_the_session_s_rows_are_not():
    """After the turn within a chunk above, the session's rows from C on are its shifted
    calls'; a request without the session stores exact blocks of the same history. The next
    turn restored the session's 56 rows (to rounding); the cache's 48 exact rows serve it now,
    and it gives the uncached numbers."""
    ids, plain, cache, served, edited, turn = _turn_within_a_chunk(3)
    served.generate(edited + [5], 1)  # no session: computed from 0, stores three exact blocks
    history = edited + turn.tokens[:1] + [9, 9, 9]
    got, expected = served.generate(history, NEW, session="s"), plain.generate(history, NEW)
    assert got.cached_tokens == 3 * C  # was 3C + 8, the session's rows
    assert [np.array_equal(x, y) for x, y in zip(got.logits, expected.logits)] == [True] * NEW
    assert served.sessions["s"].chained == len(history) + NEW - 1  # its rows are exact again


def test_hit_tokens_count_only_tokens_restored_from_the_cache():
    """A turn the session serves restored nothing from the cache, but its matching blocks were
    counted as hits (64 hit tokens where 32 were restored)."""
    rng = np.random.default_rng(0)
    a = [int(t) for t in rng.integers(1, 384, 40)]
    cache = PrefixCache(block_size=C, max_blocks=16)
    served = CachedPipeline(pipeline("llama", "chunked", "numpy"), cache)
    served.generate(a, 2)  # stores two blocks
    served.start_chat("s")
    first = served.generate(a[:35], 3, session="s")
    assert first.cached_tokens == 2 * C  # from the cache
    second = served.generate(a[:35] + first.tokens + [5, 5], 3, session="s")
    assert second.cached_tokens == 37  # from the session
    stats = cache.stats
    assert (stats.requests, stats.prompt_tokens, stats.hit_tokens) == (3, 40 + 35 + 40, 2 * C)
    assert stats.hit_rate == 2 * C / 115


def test_longrope_rows_are_restored_only_on_their_side_of_the_switch():
    """phi3_longrope (64 original positions): a prompt's rows rotate at the long factors when
    its end reaches 64 (`kvc.passes.prompt_end`). A 72-token prompt sharing two blocks with a
    cached 40-token one must not restore them (they rotate at the short factors); one sharing
    four blocks with a cached long prompt, or two with a short one, restores them. Each run
    is the source model's. With the blocks keyed by ids alone the 72-token prompt restored
    the short rows, and its logits were not the source's."""
    from kvc.runtime.compare import judge
    from kvc.runtime.generate import greedy
    from kvc.runtime.session import open_session
    from tests.runtime.test_static_pipeline import LONGROPE, longrope_pipeline

    source = open_session(fixtures.path("phi3_longrope"), "openvino")
    served = CachedPipeline(longrope_pipeline(LONGROPE["chunked"]), PrefixCache(block_size=C))
    rng = np.random.default_rng(4)
    a = list(rng.integers(1, 384, 40))
    b = a[:2 * C] + list(rng.integers(1, 384, 40))
    c = b[:4 * C] + list(rng.integers(1, 384, 10))
    d = a[:2 * C] + list(rng.integers(1, 384, 8))
    for what, prompt, hit in (("short", a, 0), ("long, a's blocks short", b, 0), ("long after long", c, 4 * C),
                              ("short after short", d, 2 * C)):
        got = served.generate(prompt, NEW)
        assert got.cached_tokens == hit, f"{what}: restored {got.cached_tokens} tokens, expected {hit}"
        verdict = judge(greedy(source, np.asarray(prompt), NEW), got)
        assert verdict.ok, f"{what}: {verdict.reason}"


def test_a_longrope_session_turn_that_crosses_the_switch_restores_nothing():
    """A session's first turn (40 tokens and its 3) rotates at the short factors; the next
    (70 tokens) reaches 64, so a run of it from position 0 rotates every row at the long
    ones: it restores nothing, and the turn after it restores its rows. Each turn is the
    source's run of its whole history."""
    from kvc.runtime.compare import judge
    from kvc.runtime.generate import greedy
    from kvc.runtime.session import open_session
    from tests.runtime.test_static_pipeline import LONGROPE, longrope_pipeline

    source = open_session(fixtures.path("phi3_longrope"), "openvino")
    served = CachedPipeline(longrope_pipeline(LONGROPE["chunked"]))
    rng = np.random.default_rng(5)
    served.start_chat("s")
    history = list(rng.integers(1, 384, 40))
    for turn, hit in enumerate((0, 0, 72)):
        got = served.generate(history, NEW, session="s")
        assert got.cached_tokens == hit, f"turn {turn}: restored {got.cached_tokens}, expected {hit}"
        verdict = judge(greedy(source, np.asarray(history), NEW), got)
        assert verdict.ok, f"turn {turn}: {verdict.reason}"
        history = history + got.tokens + list(rng.integers(1, 384, 27 if turn == 0 else 6))


def test_a_pipeline_reading_the_prompt_end_without_its_switch_is_refused():
    """Keying rows by LongRoPE's side needs the switch the plan records; a pipeline whose
    prefill reads the prompt's end and whose plan has none cannot be cached soundly."""
    import dataclasses

    from tests.runtime.test_static_pipeline import LONGROPE, longrope_pipeline

    with pytest.raises(UsageError, match="records no LongRoPE switch"):
        CachedPipeline(longrope_pipeline(dataclasses.replace(LONGROPE["chunked"], longrope_switch=None)))
