"""CachedPipeline: a StaticPipeline that remembers KV across requests.

    pipe = CachedPipeline(open_compiled(OUT, "openvino"), PrefixCache(block_size=64))
    pipe.generate(prompt, 32)                        # restores cached leading blocks
    pipe.start_chat("s"); pipe.generate(history, 32, session="s"); pipe.finish_chat("s")

Rules:

* The KV rows a request restores are exactly rows the pipeline computed before for the same
  tokens from position 0, so the prefill computes only the rest, in chunks starting where the
  restored rows end (`StaticPipeline.generate(reuse=...)`). At least the last prompt token is
  always computed: its logits choose the first new token. Restoring needs a chunked prefill
  (as NPUW's prefix caching does); a prefix cache over an unchunked pipeline is refused.
* Prefix cache: the leading blocks of the prompt that are cached. After the request, every
  full block of prompt + generated tokens whose rows were computed is stored; a generated
  token's rows are its decode step's, which a prefill of the same tokens computes on another
  model: restored, they agree with an uncached run to the arithmetic's rounding, not bit for
  bit (docs/kv-cache.md), as a session's turn does.
* Chat session (openvino.genai's start_chat/finish_chat; seed 000's aligning of the KV cache
  with the history): the session keeps the rows of its last sequence (prompt and generated
  tokens). A turn gives the whole history; the rows of its longest common prefix with the
  stored sequence are restored, so an edited earlier turn rolls the cache back to where it
  diverges. A session over an unchunked prefill restores nothing (each turn prefills all of
  it) and says so by `cached_tokens` 0. A history longer than the prefill takes is an error
  that quotes the numbers; nothing is truncated.
* When both could serve, the session serves if it restores more rows than the cache's blocks
  and its rows are exact (`ChatSession.chained`: not placed, and computed by the calls a run
  from position 0 makes) as far as the blocks reach; else the blocks do.
* A session turn whose prefix ends within a chunk computes the rest with calls that start
  there, not where a run from 0 starts them: its rows from the chunk boundary below that
  prefix on are stored for chunk reuse only (when it is on), never under a chained key, so a
  later prefix hit stays exact.
* Chunk reuse (opt-in, `kvc.cache.chunks`): after the exact prefix, blocks cached anywhere
  with the same tokens are moved here and placed, seams repaired; the request reports them
  as `placed_tokens` and its rows from the first placed block on are stored for chunk reuse
  only. A session keeps where its rows stop being exact (`ChatSession.exact`): a later turn
  restoring rows past it counts them as placed and stores them for chunk reuse only.
* A vision-language prompt's image (`media=`, `kvc.runtime.embeddings.Media`) keys the rows
  it touches: prefix blocks and a session's rows are restored only where the ids, the image
  and the mRoPE positions all agree (`Media.tags`). A model that reads `token_type_ids`
  computes an image both ways only in a call over no past, so it restores rows only when no
  prefill call after them would compute an image again (`StaticPipeline.keeps`); else the
  request restores nothing. A request with media reuses no chunks (a chunk store keys rows by
  ids alone).
* A LongRoPE model (Phi-3's long-context models, Phi-4-mini) rotates a prompt's rows at the
  long factors when its end reaches the original positions T, else at the short ones
  (`kvc.passes.prompt_end`; a generated token's row: by its own position). So a row is keyed
  by its side of T with its id (`longrope_tags`, beside `Media.tags`): a prompt restores only
  the rows computed on its own side, and a session turn that crosses T restores nothing. The
  plan records T (`StaticOptions.longrope_switch`); a pipeline whose prefill reads the
  prompt's end without it is refused.
* Everything a request could be refused for is checked before the cache or a session changes.
* TTFT (`prefill_seconds`) includes looking the blocks up and restoring them; storing blocks
  after the request does not delay its first token and is not in it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvc.cache.chunks import ChunkReuse, plan_chunks, take_rows
from kvc.cache.prefix import PrefixCache, Retention
from kvc.errors import UsageError
from kvc.passes.prompt_end import PROMPT_LAST_POSITION
from kvc.runtime.embeddings import Media
from kvc.runtime.static_pipeline import PromptTooLongError, StaticGeneration, StaticPipeline, token_ids


@dataclass
class ChatSession:
    name: str
    tokens: list[int] = field(default_factory=list)  # the sequence whose KV rows are kept
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    exact: int = 0  # its leading rows computed without chunk reuse; the rest are approximate
    chained: int = 0  # its leading rows a run of them from position 0 computes (what a chained key may name)
    tags: np.ndarray | None = None  # its rows' (`sequence_tags`), None: keyed by ids alone


def common_prefix(a, b, tags_a: np.ndarray | None = None, tags_b: np.ndarray | None = None) -> int:
    """The length of the longest common prefix of sequences `a` and `b`: ids, and with them
    their tags (`sequence_tags`; None: all 0, a missing column: 0), equal."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64)
    if tags_a is not None or tags_b is not None:
        width = max(t.shape[1] for t in (tags_a, tags_b) if t is not None)
        ta, tb = (np.zeros((n, width), np.int64) if t is None else
                  np.pad(t[:n], ((0, 0), (0, width - t.shape[1]))) for t in (tags_a, tags_b))
        differ |= (ta != tb).any(axis=1)
    diff = np.flatnonzero(differ)
    return int(diff[0]) if diff.size else n


def longrope_tags(switch: int, prompt_len: int, count: int) -> np.ndarray | None:
    """LongRoPE's side of T (`switch`) of each of the first `count` rows of a sequence that
    begins with a `prompt_len`-token prompt, [count, 1] int64: 1 where the row rotates at the
    long factors (a prompt's rows: its end reaches T, `prompt_len > T`; a generated token's at
    position p: `p + 1 > T`, as its step's call), None where every row rotates at the short ones."""
    side = np.maximum(prompt_len, np.arange(1, count + 1)) > switch
    return side.astype(np.int64)[:, None] if side.any() else None


def sequence_tags(media: Media | None, switch: int | None, prompt_len: int, count: int) -> np.ndarray | None:
    """What a cache keys the first `count` rows of a sequence on besides their ids: the media's
    `Media.tags` ([count, 4]), then LongRoPE's side (`longrope_tags`) in a fifth column where
    any row is on the long one; None when all are 0."""
    tags = media.tags(count) if media is not None else None
    side = longrope_tags(switch, prompt_len, count) if switch is not None else None
    if side is None:
        return tags
    return np.concatenate([np.zeros((count, 4), np.int64) if tags is None else tags, side], axis=1)


def check_fits(pipe: StaticPipeline, prompt: np.ndarray, new_tokens: int, session: str | None) -> None:
    """`StaticPipeline.check_fits`; a session's turn (its whole history) that no longer fits
    says so."""
    try:
        pipe.check_fits(prompt, new_tokens)
    except PromptTooLongError as exc:
        if session is None:
            raise
        raise PromptTooLongError(f"chat session {session!r}: the history of {len(prompt)} tokens no longer fits "
                                 f"the prefill ({exc}); finish the session or start a new one") from None


class CachedPipeline:
    """A StaticPipeline with a prefix cache (optional) and chat sessions."""

    def __init__(self, pipeline: StaticPipeline, cache: PrefixCache | None = None, chunks: ChunkReuse | None = None):
        chunk = pipeline.lengths.chunk
        if cache is not None:
            if not chunk:
                raise UsageError("prefix caching needs a chunked prefill (as NPUW's does): compile with "
                                 "--prefill-chunk-size (a power of two)")
            if cache.block_size % chunk:
                raise UsageError(f"the prefix-caching block size {cache.block_size} must be a multiple of the "
                                 f"prefill chunk size {chunk}")
        if chunks is not None and cache is None:
            raise UsageError("chunk reuse keeps its chunks in the prefix cache: enable prefix caching too")
        self.switch = pipeline.plan.options.longrope_switch
        if self.switch is None and any(s.has_input(PROMPT_LAST_POSITION) for s in pipeline.sessions()):
            raise UsageError("this pipeline's prefill reads the prompt's last position (prompt-end: LongRoPE's "
                             "factors), and its plan records no LongRoPE switch (longrope_switch) to key cached "
                             "rows by: compile it again with this kvc")
        self.pipeline, self.cache, self.chunks = pipeline, cache, chunks
        self.sessions: dict[str, ChatSession] = {}

    # -- chat sessions ---------------------------------------------------------------------
    def start_chat(self, name: str) -> None:
        if name in self.sessions:
            raise UsageError(f"chat session {name!r} is already open")
        self.sessions[name] = ChatSession(name)

    def finish_chat(self, name: str) -> None:
        """Close a session and free its KV rows."""
        if name not in self.sessions:
            raise UsageError(f"no chat session {name!r} is open")
        del self.sessions[name]

    # -- requests --------------------------------------------------------------------------
    def generate(self, prompt, new_tokens: int, *, retention: Retention | None = None,
                 session: str | None = None, sampling=None, on_token=None,
                 media: Media | None = None) -> StaticGeneration:
        pipe = self.pipeline
        prompt = token_ids(prompt)
        chat = None
        if session is not None:
            chat = self.sessions.get(session)
            if chat is None:
                raise UsageError(f"no chat session {session!r} is open (start_chat first)")
        n = len(prompt)
        check_fits(pipe, prompt, new_tokens, session)
        if retention is not None:
            retention.check(n)
        if media is not None:
            pipe.check_media(n, media)
        tags = sequence_tags(media, self.switch, n, n)
        started = time.perf_counter()  # TTFT includes finding and restoring the rows
        limit = n - 1 if pipe.lengths.chunk else 0  # the last prompt token is always computed
        blocks = self.cache.lookup(prompt, limit, tags) if self.cache is not None else []
        if blocks and not pipe.keeps(n, len(blocks) * self.cache.block_size, media):
            blocks = []
        hit = len(blocks) * (self.cache.block_size if self.cache else 0)
        lcp = min(common_prefix(chat.tokens, prompt, chat.tags, tags), limit) if chat is not None else 0
        if not pipe.keeps(n, lcp, media):
            lcp = 0
        reuse, after, inherited, from_cache = 0, None, None, 0  # inherited: where the restored rows stop being exact
        chained = None  # where the rows stop being those a run from position 0 computes (None: they all are)
        # The session serves when it restores more rows than the cache and, of them, every row the cache
        # would restore as a run from 0 computes them: its rows may be a placed (approximate) or an earlier
        # turn's shifted calls' (rounding), where the cache's blocks are exact.
        if chat is not None and lcp > hit and min(lcp, chat.chained) >= hit:
            pipe.restore_rows({spec.input: take_rows(chat.rows[spec.input], spec.seq_axis, 0, lcp)
                               for spec in pipe.kv}, 0)
            reuse = lcp
            inherited = chat.exact if chat.exact < lcp else None
            # The calls after a prefix that ends within a chunk start there, not where a run from 0 starts
            # them: the rows from the chunk boundary below it on agree with that run to rounding only.
            boundary = lcp - lcp % pipe.lengths.chunk
            if chat.chained < lcp or boundary < lcp:
                chained = min(chat.chained, boundary)
        elif hit:
            for i, block in enumerate(blocks):
                pipe.restore_rows(block.rows, i * self.cache.block_size)
            self.cache.use(blocks, retention, n)
            reuse, after, from_cache = hit, blocks[-1].origin, hit
        if self.cache is not None:  # the tokens restored from its blocks: none when the session served
            self.cache.record_lookup(n, from_cache)
        plan = None
        if self.chunks is not None and limit and media is None:
            B = self.cache.block_size
            plan = plan_chunks(self.cache, self.chunks, prompt, -(-reuse // B) * B, pipe.lengths.chunk,
                               {spec.input: spec.seq_axis for spec in pipe.kv}, after)
            for block in plan.blocks:
                self.cache.touch(block)
        restoring = time.perf_counter() - started
        gen = pipe.generate(prompt, new_tokens, reuse=reuse, placed=tuple(plan.placed) if plan else (),
                            sampling=sampling, on_token=on_token, media=media)
        gen.prefill_seconds += restoring
        if inherited is not None:  # a session's rows computed after an earlier turn's placed rows
            gen.placed_tokens += reuse - inherited
        sequence = np.concatenate([prompt, np.asarray(gen.tokens[:-1], np.int64)])[:gen.kv_rows]
        exact = min([gen.kv_rows, *(x for x in (inherited, plan.first if plan else None) if x is not None)])
        chained = exact if chained is None else min(exact, chained)
        kept_tags = sequence_tags(media, self.switch, n, gen.kv_rows)  # a generated token's: its own
        if self.cache is not None:
            self.cache.store(sequence, chained, pipe.copy_rows, retention, n, kept_tags)
            # the rest for chunk reuse (a chunk store keys rows by ids alone, so not with media), from the
            # block the chained ones stop in; placed and so counted wherever chunk reuse finds them
            if chained < gen.kv_rows and media is None and (self.chunks is not None or exact < gen.kv_rows):
                B = self.cache.block_size
                self.cache.store_approximate(sequence, chained - chained % B, gen.kv_rows, pipe.copy_rows)
        if chat is not None:
            chat.tokens = [int(t) for t in sequence]
            chat.rows = pipe.copy_rows(0, gen.kv_rows)
            chat.exact, chat.chained, chat.tags = exact, chained, kept_tags
        return gen


def replay(pipe: CachedPipeline, entries, encode=None, source: str = "<requests>", on_result=None,
           sampling=None) -> list[dict]:
    """Run a parsed workload (`kvc.cache.requests`) in order: a request with a session opens
    it on its first turn, `finish_session` closes it. One dict per request: its tokens, how
    many prompt tokens were restored, TTFT and per-token latency (ms). `encode` tokenizes
    text prompts. Every request is checked before any runs (`preflight`): a request that
    cannot run is an error naming its line, and nothing has run."""
    from kvc.cache.requests import FinishSession

    prompts = preflight(pipe, entries, encode, source)
    results = []
    for entry, ids in zip(entries, prompts):
        try:
            if isinstance(entry, FinishSession):
                pipe.finish_chat(entry.session)
                continue
            if entry.session is not None and entry.session not in pipe.sessions:
                pipe.start_chat(entry.session)
            gen = pipe.generate(ids, entry.max_new_tokens, retention=entry.retention, session=entry.session,
                                sampling=sampling, media=entry.media)
        except UsageError as exc:
            raise type(exc)(f"{source}:{entry.line}: {_what(entry)}: {exc}") from None
        m = gen.metrics()
        result = {"id": entry.id, "line": entry.line, "session": entry.session, "prompt_tokens": len(ids),
                  "cached_tokens": gen.cached_tokens, "approximate_tokens": gen.placed_tokens, "tokens": gen.tokens,
                  "finish_reason": gen.finish_reason,
                  "ttft_ms": m["ttft_ms"],
                  "tpot_ms": m["tpot_ms"]["mean"] if m["tpot_ms"] else None, "variants": m["variants"],
                  **({} if entry.media is None else {"images": entry.media.extents()})}
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _what(entry) -> str:
    from kvc.cache.requests import FinishSession

    return "finish_session" if isinstance(entry, FinishSession) else f"request {entry.id!r}"


def preflight(pipe: CachedPipeline, entries, encode=None, source: str = "<requests>") -> list:
    """Each entry's prompt ids (None for `finish_session`), every request checked as `replay`
    will run it, before any runs: a text prompt needs a tokenizer; the prompt must fit the
    pipeline (`StaticPipeline.check_fits`: ids in the vocabulary, at most P tokens, the new
    tokens within the capacity; a session's turn is its whole history); retention ranges
    inside the prompt; images that fit the prompt and the model (`StaticPipeline.check_media`);
    `finish_session` of a session open at that line. A workload that
    failed at its seventh request used to have run six, with no events file written and no
    table printed."""
    from kvc.cache.requests import FinishSession

    open_sessions = set(pipe.sessions)
    prompts = []
    for entry in entries:
        try:
            if isinstance(entry, FinishSession):
                if entry.session not in open_sessions:
                    raise UsageError(f"no chat session {entry.session!r} is open")
                open_sessions.discard(entry.session)
                prompts.append(None)
                continue
            ids = entry.prompt_ids
            if ids is None:
                if encode is None:
                    raise UsageError("a text prompt needs the model's tokenizer")
                ids = encode(entry.prompt)
            prompt = token_ids(ids)
            check_fits(pipe.pipeline, prompt, entry.max_new_tokens, entry.session)
            if entry.retention is not None:
                entry.retention.check(len(prompt))
            if entry.media is not None:
                pipe.pipeline.check_media(len(prompt), entry.media)
            if entry.session is not None:
                open_sessions.add(entry.session)
            prompts.append(ids)
        except UsageError as exc:
            raise type(exc)(f"{source}:{entry.line}: {_what(entry)}: {exc}") from None
    return prompts
