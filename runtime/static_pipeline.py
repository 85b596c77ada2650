"""Greedy generation through static models, exactly as the NPU plugin drives them (REFERENCE.md §4).

* Prefill is right-aligned (left-padded): a prompt of n ≤ P tokens sits in the last n slots;
  its valid cache rows are `present[P-n:P]`. Chunked prefill feeds C tokens at a time with
  a past of P - C slots; a partial last chunk is left-padded the same way. With bulk chunks
  (prefill models of B > C tokens, past P - B) a long prompt takes fewer calls, and a
  first-chunk model (F tokens, no past) computes a prompt's positions `[0, F)` reading the
  prompt alone (one of dynamic rows takes its `k <= F` tokens unpadded): the split
  minimizes the rows computed plus CALL_ROWS per call
  (`prefill_calls`).
* One KV buffer per cache tensor, sized for the largest variant; every variant reads a
  prefix of it (the past is left-aligned: rows `[0:num_stored]` are valid), so switching
  variants copies nothing.
* Generate starts on the smallest variant T with T >= n + R; each step feeds one token with
  mask ones over `[0:num_stored]` and the last slot, then writes the present row at
  `num_stored`. When a variant's past is full the next larger one takes over.
* A prompt longer than P, or more tokens than the largest variant holds, is an error that
  quotes the effective numbers; nothing is truncated or wrapped silently.

Capacity: a step of variant T attends over T positions (T - 1 past, 1 new), so a prompt of n
tokens can be followed by at most T_max - n + 1 generated tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvc.errors import UsageError
from kvc.passes.prompt_end import PROMPT_LAST_POSITION
from kvc.plan import KVSpec, LengthPlan, StaticPlan
from kvc.runtime.embeddings import Media, token_feed
from kvc.runtime.generate import Generation, far_past, far_past_fits
from kvc.runtime.sampling import Sampling
from kvc.runtime.session import Session


TOKEN_IDS = "the prompt must be a list of token ids (integers from 0 to 2^63 - 1)"


def token_ids(prompt) -> np.ndarray:
    """`prompt` as a 1-D int64 array. It must be a flat sequence (a list, tuple or 1-D array) of
    integers from 0 to 2^63 - 1: floats (1.9 was taken as 1), bools, strings ("5" was taken as
    5), nested lists and 2-D arrays (flattened) and a scalar are a UsageError naming what was
    found, never converted. Negative ids pass here: `check_fits` refuses them with the
    vocabulary's range."""
    if isinstance(prompt, (str, bytes)):
        raise UsageError(f"{TOKEN_IDS}, found a string: tokenize it first")
    try:
        a = np.asarray(prompt)
    except (ValueError, TypeError):  # a ragged nesting
        raise UsageError(f"{TOKEN_IDS}, found a nested sequence") from None
    if a.ndim != 1:
        found = "a single value" if a.ndim == 0 else f"a nested sequence (shape {list(a.shape)})"
        raise UsageError(f"{TOKEN_IDS}, found {found}")
    if not a.size:
        return np.zeros(0, np.int64)  # `check_fits`: the prompt is empty
    listed = isinstance(prompt, (list, tuple))  # np.asarray([True, 2]) is an int64 array: look at each item
    if not listed and (a.dtype.kind == "i" or (a.dtype.kind == "u" and int(a.max()) <= np.iinfo(np.int64).max)):
        return a.astype(np.int64, copy=False)
    items = prompt if listed else a.tolist()
    for i, t in enumerate(items):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise UsageError(f"{TOKEN_IDS}, found {t!r} ({type(t).__name__}) at position {i}")
        if not -(1 << 63) <= int(t) < (1 << 63):
            raise UsageError(f"{TOKEN_IDS}, found {int(t)} at position {i}")
    return np.asarray([int(t) for t in items], np.int64)  # Python ints of an object array, in range


class PromptTooLongError(UsageError):
    """The prompt does not fit the compiled prefill."""


class CapacityError(UsageError):
    """Generation would run past the KV capacity of the largest variant."""


@dataclass
class StaticGeneration(Generation):
    variants: list[int] = field(default_factory=list)  # variant size used by each generate step
    prefill_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # wall time of each generate step
    prompt_logits: np.ndarray | None = None  # [n, V] prefill logits of the prompt positions (unsliced prefill)
    cached_tokens: int = 0  # prompt tokens whose KV rows were restored, not computed (prefix cache, chat session)
    placed_tokens: int = 0  # prompt tokens whose rows were reused from another context: approximate (chunk reuse)
    finish_reason: str = "length"  # "stop": an end-of-sequence token ended it
    kv_rows: int = 0  # cache rows valid after the call: the prompt, then every generated token but the last

    def metrics(self, load_seconds: float | None = None) -> dict:
        """What openvino.genai's PerfMetrics report, in milliseconds: TTFT (the prefill, which
        yields the first token), TPOT (each later token: one generate step) as mean, p50 and
        p90, throughput in tokens per second after the first (1000 / mean TPOT, as genai), the
        whole generation, and the load time when given. Wall clock, this run only."""
        steps = np.asarray(self.step_seconds, dtype=np.float64) * 1e3
        tpot = ({"mean": float(steps.mean()), "p50": float(np.percentile(steps, 50)),
                 "p90": float(np.percentile(steps, 90))} if steps.size else None)
        return {
            "load_ms": None if load_seconds is None else load_seconds * 1e3,
            "ttft_ms": self.prefill_seconds * 1e3,
            "tpot_ms": tpot,
            "throughput_tokens_per_s": 1e3 / tpot["mean"] if tpot and tpot["mean"] > 0 else None,
            "generate_ms": (self.prefill_seconds + float(np.sum(self.step_seconds))) * 1e3,
            "new_tokens": len(self.tokens),
            "cached_tokens": self.cached_tokens,
            "approximate_tokens": self.placed_tokens,
            "finish_reason": self.finish_reason,
            "variants": sorted(set(self.variants)),
        }


def max_new_tokens(lengths: LengthPlan, prompt_len: int) -> int:
    """How many tokens can follow a prompt of `prompt_len` tokens."""
    return lengths.capacity - prompt_len + 1


class StaticPipeline:
    """Drives one prefill session and generate sessions by size over one shared KV buffer."""

    def __init__(self, prefill: Session, generate: dict[int, Session], plan: StaticPlan, pad_token: int = 0,
                 vocab: int | None = None, bulk: dict[int, Session] | None = None,
                 first: dict[int, Session] | None = None):
        lengths, bulk, first = plan.lengths, bulk or {}, first or {}
        if sorted(generate) != sorted(lengths.sizes):
            raise UsageError(f"generate sessions {sorted(generate)} do not match the plan's sizes {list(lengths.sizes)}")
        if sorted(bulk) != list(lengths.bulk):
            raise UsageError(f"bulk prefill sessions {sorted(bulk)} do not match the plan's bulk chunks "
                             f"{list(lengths.bulk)}")
        if sorted(first) != list(lengths.first):
            raise UsageError(f"first-chunk sessions {sorted(first)} do not match the plan's first chunks "
                             f"{list(lengths.first)}")
        self.prefill, self.generate_sessions, self.plan = prefill, generate, plan
        self.prefill_sessions = {lengths.chunk: prefill, **bulk}  # by chunk size (0: unchunked)
        self.first_sessions = first  # by size: no past, nothing bound
        self.lengths, self.kv = lengths, plan.kv
        self.pad_token, self.vocab = pad_token, vocab  # vocab: token ids are checked against it when known
        # Held as the sessions take them: a bf16 cache is f32 holding bf16 values for kvc's
        # interpreter and bf16 bytes (ml_dtypes.bfloat16) for a device.
        session = next(iter(generate.values()))
        self.buffers = {k.input: np.zeros(k.shape, session.input_dtype(k.input)) for k in self.kv}
        self._written = 0  # every row from here on is zero in every buffer (`_store` moves it)
        # Every session with a past reads its prefix of the shared buffers directly (bound
        # once, here): a step copies only its new rows, never the cache.
        pasts = [(s, size - lengths.tokens) for size, s in generate.items()]
        if lengths.chunk:
            pasts += [(session, lengths.prompt - size) for size, session in self.prefill_sessions.items()]
        for session, rows in pasts:
            for spec in self.kv:
                session.bind(spec.input, self.buffers[spec.input], rows, spec.seq_axis)

    def sessions(self) -> list[Session]:
        """Every session, each once: the prefill, bulk and first-chunk ones, then the generate
        variants."""
        every = [*self.prefill_sessions.values(), *self.first_sessions.values(), *self.generate_sessions.values()]
        return list({id(s): s for s in every}.values())

    # -- buffer views ------------------------------------------------------------------------
    def _rows(self, spec: KVSpec, start: int, stop: int) -> tuple:
        index = [slice(None)] * len(spec.shape)
        index[spec.seq_axis] = slice(start, stop)
        return tuple(index)

    def past_view(self, spec: KVSpec, length: int) -> np.ndarray:
        """The first `length` rows of the shared buffer: what a variant with that past reads."""
        return self.buffers[spec.input][self._rows(spec, 0, length)]

    def _store(self, spec: KVSpec, rows: np.ndarray, at: int, take: slice | None = None) -> None:
        if take is not None:
            src = [slice(None)] * rows.ndim
            src[spec.seq_axis] = take
            rows = rows[tuple(src)]
        n = rows.shape[spec.seq_axis]
        self.buffers[spec.input][self._rows(spec, at, at + n)] = rows
        self._written = max(self._written, at + n)

    def clear_from(self, row: int) -> None:
        """Zero every buffer's rows from `row` on, in place (sessions hold views of the buffers):
        masked rows get a weight of exactly 0, but 0 times a NaN left by an earlier run is NaN.
        Only rows written since the last clearing (a 16-token prompt at P 1024 zeroed 1152 rows
        of 32 tensors: 4.4 ms of a 60 ms first token on the bench model)."""
        for spec in self.kv:
            self.buffers[spec.input][self._rows(spec, row, max(row, self._written))] = 0
        self._written = min(self._written, row)

    def copy_rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """A copy of cache rows `[start:stop]` of every KV tensor, by input name."""
        return {spec.input: self.buffers[spec.input][self._rows(spec, start, stop)].copy() for spec in self.kv}

    def restore_rows(self, rows: dict[str, np.ndarray], at: int) -> None:
        """Write rows (as `copy_rows` gave them) into the cache from row `at` on."""
        for spec in self.kv:
            self._store(spec, rows[spec.input], at)

    def fill_far_past(self, rows: int) -> None:
        """Rows `[0, rows)` of every cache tensor as `far_past` gives them, what a far probe
        starts over (`kvc.verify.compiled.probe_cases`; the source model's cache is given the
        same, `greedy(filled=True)`): exact in a float cache, and only there (`far_past_fits`)."""
        types = [spec.element_type for spec in self.kv]
        if not far_past_fits(types):
            raise UsageError("a far past needs a float cache (f32, f16 or bf16), not "
                             f"{sorted(set(types) - {'f32', 'f16', 'bf16'})}")
        for spec in self.kv:
            shape = list(spec.shape)
            shape[spec.seq_axis] = rows
            self._store(spec, far_past(spec.input, shape, spec.seq_axis).astype(self.buffers[spec.input].dtype), 0)

    # -- steps -----------------------------------------------------------------------------
    @staticmethod
    def step_feed(session: Session, ids, mask, positions, media: Media | None = None, at=None,
                  last: int | None = None) -> dict:
        """This step's small inputs, for the inputs `session` has; the past is bound to the
        shared buffers (a caller feeding its own past adds it). `media` and `at`: see
        `token_feed`. `last`: the prompt's last position, for a prefill model that reads it
        (`kvc.passes.prompt_end`); None: this call's largest, as if it held the whole prompt."""
        feed = {**token_feed(session, ids, media, at), "attention_mask": mask, "position_ids": positions,
                "beam_idx": np.zeros(1, np.int32)}
        if session.has_input(PROMPT_LAST_POSITION):
            feed[PROMPT_LAST_POSITION] = np.array(int(np.max(positions)) if last is None else last, np.int64)
        return {k: v for k, v in feed.items() if session.has_input(k)}

    def _prefill(self, prompt: np.ndarray, start: int = 0, skip: tuple[tuple[int, int], ...] = (),
                 origin: int = 0, media: Media | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Fill the cache with the prompt from `start` on (rows before it are in place, and so
        are the rows of each `skip` span; those before `origin` are empty and masked); return
        the last position's logits and the computed positions' logits (None unless every
        position was computed). `media`: the prompt's (`Media`), from position 0."""
        P, C, n = self.lengths.prompt, self.lengths.chunk, len(prompt)
        if not C:  # the whole prompt in one call over no past, as a first chunk of P rows is
            calls = [Call(0, n, P, True)]
        elif not start and self.both_ways(media):
            calls = media_calls(self.lengths, n, media.end)
        else:
            calls = prefill_calls(start, n, skip, P, (C, *self.lengths.bulk), self.lengths.first,
                                  self.lengths.first_dynamic)
        rows = []
        for begin, end, size, first in calls:
            session = (self.first_sessions if first else self.prefill_sessions)[size] if C else self.prefill
            chunk = prompt[begin:end]
            k, stored = len(chunk), begin  # every row before `begin` is in place (none for a first chunk)
            if first and self.lengths.first_dynamic:  # its model takes the chunk's rows unpadded
                size = k
            ids = np.full((1, size), self.pad_token, np.int64)
            ids[0, size - k:] = chunk
            at = np.full((1, size), -1, np.int64)  # each row's prompt position (-1: a pad)
            at[0, size - k:] = np.arange(begin, end)
            width = size if first else P  # the mask spans the past and the chunk's rows
            mask = np.zeros((1, width), np.int64)
            mask[0, origin:stored] = 1
            mask[0, width - k:] = 1
            pos = np.zeros((1, size), np.int64)
            pos[0, size - k:] = np.arange(stored, stored + k)
            if media is not None and media.positions is not None:  # mRoPE's sections, [3, 1, size]
                pos = np.repeat(pos[None], 3, axis=0)
                pos[:, 0, size - k:] = np.asarray(media.positions, np.int64)[:, begin:end]
            out = session.infer(self.step_feed(session, ids, mask, pos, media, at, last=n - 1))
            for spec in self.kv:
                self._store(spec, out[spec.output], stored, slice(size - k, size))
            logits = out["logits"][0]
            rows.append(logits[size - k:] if logits.shape[0] == size else None)
        prompt_logits = None if skip or any(r is None for r in rows) else np.concatenate(rows)
        return logits[-1], prompt_logits

    def check_media(self, n: int, media: Media) -> None:
        """Refuse `media` this pipeline cannot run with an `n`-token prompt: media that do not
        fit the prompt or the model (`Media.check`), or, for a model that reads
        `token_type_ids`, media no first prefill call holds (`media_calls`)."""
        media.check(n, getattr(self.prefill, "embed", None))
        if self.lengths.chunk and self.both_ways(media):
            media_calls(self.lengths, n, media.end)

    def both_ways(self, media: Media | None) -> bool:
        """Whether `media` hold an image this model lets attend itself both ways, which only a
        prefill call over no past computes (it reads `token_type_ids`: Gemma 3; `Media`)."""
        return media is not None and bool(media.spans) and self.prefill.has_input("token_type_ids")

    def keeps(self, n: int, reuse: int, media: Media | None) -> bool:
        """Whether an `n`-token prompt with `media` may restore the rows of its first `reuse`
        tokens: always, but for a model that reads `token_type_ids`, whose image's tokens
        attend each other both ways only in a call over no past, and whose prefill would then
        compute one again over the restored rows (it starts at the chunk multiple below `reuse`
        where a call cannot start at `reuse`, `prefill_calls`). Such a prompt restores
        nothing; the first call holds its media (`media_calls`)."""
        L = self.lengths
        if not reuse or not self.both_ways(media):
            return True
        return L.chunk > 0 and all(call.begin >= media.end for call in prefill_calls(
            reuse, n, (), L.prompt, (L.chunk, *L.bulk), L.first, L.first_dynamic))

    def check_fits(self, prompt: np.ndarray, new_tokens: int) -> None:
        """Refuse a request the pipeline cannot serve (empty prompt, ids outside the vocabulary,
        a prompt longer than P, more tokens than the capacity), with the numbers."""
        L, n = self.lengths, len(prompt)
        if n == 0:
            raise UsageError("the prompt is empty")
        outside = np.flatnonzero((prompt < 0) | (prompt >= (self.vocab or np.iinfo(np.int64).max)))
        if outside.size:
            i = int(outside[0])
            raise UsageError(f"token id {int(prompt[i])} at position {i} of the prompt is outside the vocabulary "
                             f"(ids 0 to {self.vocab - 1 if self.vocab else 'any non-negative'})")
        if n > L.prompt:  # first: a caller sizing new_tokens by the room left asks for fewer than 1 then
            raise PromptTooLongError(
                f"prompt of {n} tokens does not fit: the prefill model takes at most {L.prompt} "
                f"(max prompt length {L.prompt}, chunk {L.chunk or 'none'})")
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, (int, np.integer)):
            raise UsageError(f"the number of new tokens must be an integer, got {new_tokens!r}")
        if new_tokens < 1:
            raise UsageError(f"the number of new tokens must be at least 1, got {new_tokens}")
        limit = max_new_tokens(L, n)
        if new_tokens > limit:
            raise CapacityError(
                f"{new_tokens} new tokens after a {n}-token prompt exceed the KV capacity: the largest "
                f"generate variant holds {L.capacity} positions (P {L.prompt} + R {L.response}), "
                f"so at most {limit} tokens can follow this prompt")

    def _decode_step(self, variant: int, token: int, stored: int, origin: int = 0,
                     shift: int = 0) -> tuple[np.ndarray, bool]:
        """One generate step on `variant` with `stored` rows in the cache (those before
        `origin` empty and masked), its token at position `stored + shift` (`Media.shift`);
        stores the new rows and returns the step's last logits and whether the rows were
        stored."""
        G = self.lengths.tokens
        session = self.generate_sessions[variant]
        mask = np.zeros((1, variant), np.int64)
        mask[0, origin:stored] = 1
        mask[0, variant - G:] = 1
        ids, pos = np.array([[token]], np.int64), np.array([[stored + shift]], np.int64)
        out = session.infer(self.step_feed(session, ids, mask, pos))
        kept = stored + G <= self.lengths.capacity - G  # the last step's row is never read again
        if kept:
            for spec in self.kv:
                self._store(spec, out[spec.output], stored)
        return out["logits"][0, -1], kept

    def generate(self, prompt, new_tokens: int, *, reuse: int = 0, placed=(), sampling: Sampling | None = None,
                 on_token=None, start_variant: int | None = None, origin: int = 0,
                 media: Media | None = None) -> StaticGeneration:
        """Decoding (greedy unless `sampling` says otherwise): prefill, then one generate step
        per token on the smallest variant that holds the prompt and R (moving up a variant when
        its past is full), until `new_tokens` or a stop token of `sampling`. `on_token(id)` is
        called as each token is chosen (streaming).

        `reuse`: the shared buffers already hold the KV rows of `prompt[:reuse]` (restored by a
        prefix cache or a chat session, `restore_rows`), so the prefill computes only the rest,
        in chunks from there. It needs a chunked prefill and at least one token to compute.
        `placed`: rows reused from another context, and `origin`, the prompt's first position:
        see `prefill_prompt`, and `media`, the prompt's rows and positions besides its ids.
        `start_variant`: see `decode_from`."""
        return self.decode_from(self.prefill_prompt(prompt, new_tokens, reuse=reuse, placed=placed, origin=origin,
                                                    media=media),
                                sampling=sampling, on_token=on_token, start_variant=start_variant)

    def prefill_prompt(self, prompt, new_tokens: int, *, reuse: int = 0,
                       placed: tuple[tuple[int, dict[str, np.ndarray]], ...] = (), origin: int = 0,
                       filled: bool = False, media: Media | None = None) -> "Prefilled":
        """The first half of `generate`: check the request and fill the cache with the prompt.
        `decode_from` finishes it, with the cache as this left it (or as `restore_rows` put
        it back).

        `placed`: (position, rows) pairs of KV rows to put at that position (after `reuse`,
        in order, not overlapping, never the last prompt token's row); the prefill computes
        only the positions no row covers, each chunk over everything before it (chunk-level
        reuse, `kvc.cache.chunks`).

        `origin`: the prompt's first position, a multiple of the chunk (a chunked prefill
        only): the rows before it stay empty and every call masks them, as if the sequence
        began there; with `filled`, they hold a far past (`fill_far_past`), attended, as if
        the sequence had run there. What compile's far probes run
        (`kvc.verify.compiled.probe_cases`): the last calls before P, over every slot of each
        chunk model's past, at a few calls' cost.

        `media`: the rows of the prompt's media tokens and its positions (`Media`: a
        vision-language model's image). Such a prompt starts at position 0 and places no rows
        (a chunk store keys rows by ids alone, and an image's tokens share one id); it may
        restore rows (`reuse`: a prefix cache keys them by the media too, `Media.tags`) where
        `keeps` says. For a model that reads `token_type_ids` its first call holds its media."""
        prompt = token_ids(prompt)
        L = self.lengths
        if origin:
            if reuse or placed or not L.chunk or origin % L.chunk or origin < 0:
                raise UsageError(f"a prompt can start at position {origin} only alone, with a chunked prefill, at a "
                                 f"multiple of the chunk ({L.chunk or 'none'})")
            prompt = np.concatenate([np.full(origin, self.pad_token, np.int64), prompt])
        n = len(prompt)
        self.check_fits(prompt, new_tokens)
        if media is not None:
            if placed or origin:
                raise UsageError("a prompt with media starts at position 0 and places no rows (a chunk store "
                                 "keys rows by their ids alone)")
            self.check_media(n, media)
            if reuse and not self.keeps(n, reuse, media):
                raise UsageError(f"the rows of the first {reuse} tokens cannot be restored: a prefill call after "
                                 f"them computes the image ending at {media.end} again over a past, where this "
                                 f"model attends an image's tokens causally (token_type_ids)")
        if reuse and not 0 < reuse < n:
            raise UsageError(f"cannot reuse the KV rows of {reuse} tokens of a {n}-token prompt: at least "
                             f"the last prompt token must be computed")
        if (reuse or placed) and not L.chunk:
            raise UsageError("reusing KV rows needs a chunked prefill (compile with --prefill-chunk-size)")
        skip, end = [], reuse
        for at, rows in placed:
            first = self.kv[0]
            count = rows[first.input].shape[first.seq_axis] if rows else 0
            if at < end or at + count > n - 1 or count < 1:
                raise UsageError(f"placed KV rows [{at}, {at + count}) must follow the restored and placed rows "
                                 f"before them (up to {end}) and leave the last prompt token ({n - 1}) to compute")
            skip.append((at, at + count))
            end = at + count
        self.clear_from(reuse)  # rows past the prompt's restored ones
        for at, rows in placed:
            self.restore_rows(rows, at)
        filled = bool(filled and origin)
        if filled:
            self.fill_far_past(origin)
        gen = StaticGeneration(prompt=[int(t) for t in prompt[origin:]], cached_tokens=reuse,
                               placed_tokens=sum(b - a for a, b in skip), origin=origin, filled=filled, media=media)
        started = time.perf_counter()
        last, gen.prompt_logits = self._prefill(prompt, max(reuse, origin), tuple(skip), 0 if filled else origin,
                                                media)
        gen.prefill_seconds = time.perf_counter() - started
        if reuse or skip:
            gen.prompt_logits = None  # the restored positions' logits were not computed
        gen.first_logits = gen.prompt_logits
        gen.kv_rows = n
        return Prefilled(gen, last, new_tokens, 0 if media is None else media.shift)

    def decode_from(self, run: "Prefilled", *, sampling: Sampling | None = None, on_token=None,
                    start_variant: int | None = None) -> StaticGeneration:
        """The second half of `generate`: the tokens after a prefilled prompt, from the
        smallest variant that holds the prompt and R, or from `start_variant` (any variant
        with a free row: compile's switch probe starts a long prompt on a small variant to
        reach the next one in a few steps)."""
        L, gen, last = self.lengths, run.generation, run.last
        n = gen.origin + len(gen.prompt)  # the rows in the cache, those before the origin included
        origin = 0 if gen.filled else gen.origin  # the first row attended
        sizes = sorted(self.generate_sessions)
        variant = first_variant(L, n)
        if start_variant is not None:
            if start_variant not in self.generate_sessions or n > start_variant - L.tokens:
                raise UsageError(f"cannot start a {n}-token prompt on generate variant {start_variant} "
                                 f"(variants {', '.join(map(str, sizes))}; it must have a free row)")
            variant = start_variant
        stored = n
        sampling = sampling or Sampling()
        choose = sampling.chooser()
        while True:
            token = choose(last)
            gen.tokens.append(token)
            gen.logits.append(np.array(last, copy=True))
            if on_token is not None:
                on_token(token)
            if token in sampling.stop:
                gen.finish_reason = "stop"
                return gen
            if len(gen.tokens) >= run.new_tokens:
                return gen
            variant = step_variant(L, variant, stored)
            started = time.perf_counter()
            last, kept = self._decode_step(variant, token, stored, origin, run.shift)
            stored += L.tokens
            gen.kv_rows = stored if kept else gen.kv_rows
            gen.variants.append(variant)
            gen.step_seconds.append(time.perf_counter() - started)

    def decode_prompt(self, prompt, new_tokens: int, *, variant: int, origin: int,
                      filled: bool = False) -> StaticGeneration:
        """Greedy decoding on generate variant `variant` alone, the prompt fed to it a token a
        step from position `origin` on (the rows before it empty and masked, as if the
        sequence began there, or with `filled` a far past, attended: `fill_far_past`):
        compile's far probe of a variant (`kvc.verify.compiled.probe_cases`),
        which reaches its last positions in a few steps, where a prompt from position 0 would
        need a prefill and then one step a position. The logits are those of the new tokens."""
        prompt = token_ids(prompt)
        L = self.lengths
        last_stored = origin + len(prompt) + new_tokens - 2  # the last step's past
        if (L.tokens != 1 or variant not in self.generate_sessions or not len(prompt) or new_tokens < 1
                or origin < 0 or last_stored > variant - L.tokens):
            raise UsageError(f"cannot decode a {len(prompt)}-token prompt and {new_tokens} new tokens on generate "
                             f"variant {variant} from position {origin}")
        self.clear_from(0)
        filled = bool(filled and origin)
        if filled:
            self.fill_far_past(origin)
        gen = StaticGeneration(prompt=[int(t) for t in prompt], origin=origin, filled=filled)
        stored, kept, attended = origin, True, 0 if filled else origin
        for token in prompt:
            last, kept = self._decode_step(variant, int(token), stored, attended)
            stored += 1
        while True:
            token = int(np.argmax(last))
            gen.tokens.append(token)
            gen.logits.append(np.array(last, copy=True))
            if len(gen.tokens) >= new_tokens:
                break
            last, kept = self._decode_step(variant, token, stored, attended)
            stored += 1
            gen.variants.append(variant)
        gen.kv_rows = stored if kept else stored - 1
        return gen


def first_variant(lengths: LengthPlan, prompt_len: int) -> int:
    """The generate variant a prompt starts on: the smallest that holds it and R, else the largest."""
    return next((s for s in lengths.sizes if s >= prompt_len + lengths.response), lengths.sizes[-1])


def step_variant(lengths: LengthPlan, variant: int, stored: int) -> int:
    """The variant a generate step runs on with `stored` rows in the cache: `variant` while its
    past has room, else the smallest whose past does (moving up copies nothing)."""
    if stored <= variant - lengths.tokens:
        return variant
    return next(s for s in lengths.sizes if s - lengths.tokens >= stored)


def variants_run(lengths: LengthPlan, prompt_len: int, new_tokens: int, start: int | None = None) -> list[int]:
    """The variant of each generate step `decode_from` runs for `new_tokens` after a prompt
    (started on `start`, or `first_variant`), with no stop token."""
    variant, stored, steps = start or first_variant(lengths, prompt_len), prompt_len, []
    for _ in range(new_tokens - 1):
        variant = step_variant(lengths, variant, stored)
        steps.append(variant)
        stored += lengths.tokens
    return steps


def host_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this host's CPU has AMX (Linux's `amx_tile` flag; False where it cannot tell)."""
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


# What a prefill call costs beyond its rows, in rows: a pass over the weights and the call's
# attention over its past. Measured on the 250M Llama at bf16 (docs/benchmarks.md): with AMX a
# 64-token call 61 ms, a 512-token one 299 ms, so 27 ms + 0.53 ms a row, the fixed part worth
# 51 rows; without AMX (AVX512_BF16) a prefill is compute-bound, a 16-row call 31 ms and a
# 128-row one 167, so 11.6 ms + 1.2 ms a row, about 10 rows, 16 taken: a 40-token prompt then
# runs three 16-row calls, 104 ms, instead of the first-chunk model's 128 rows, 145 ms.
CALL_ROWS = 64 if host_has_amx() else 16


class Call(NamedTuple):
    """One prefill call: positions `[begin, end)` by the model of `size` rows (a first-chunk
    model when `first`, else a chunk or bulk model over a past of P - size slots)."""

    begin: int
    end: int
    size: int
    first: bool = False


def prefill_calls(start: int, n: int, skip, prompt_len: int, chunks: tuple[int, ...], first: tuple[int, ...] = (),
                  dynamic: bool = False):
    """The prefill calls (`Call`) that compute positions `[start, n)` but the `skip` spans
    (sorted, disjoint), gap by gap. A call of chunk c from position s computes
    `[s, min(s + c, gap end))` over a past of P - c slots, so it must start at s <= P - c; a
    call of a first chunk F computes `[0, min(F, gap end))` over no past, so only a gap at 0
    takes one. Each gap takes the split with the least rows computed (padding included) plus
    CALL_ROWS a call; a tie goes to a first chunk, the larger first (it reads no past, and
    leaves fewer rows to calls that do: 137 tokens run first 128 and a chunk of 16, not first
    16 and a bulk 128 over a past), then to the smaller chunk first, so a bulk call reads the
    rows the smaller ones wrote. A gap whose start no call can take (a restored history ending
    within the last chunk before P) starts at the multiple of the smallest chunk below it
    instead, computing again the rows from there. A first chunk of `dynamic` rows computes
    its `min(F, gap end)` rows alone, so it costs those rows, not F."""
    begin = start
    for a, b in (*skip, (n, n)):
        if begin < a:
            yield from _gap_calls(begin, a, prompt_len, chunks, first, dynamic)
        begin = b


def media_calls(L: LengthPlan, n: int, end: int) -> list[Call]:
    """The prefill calls of an `n`-token prompt whose media end at position `end`, for a
    model that reads `token_type_ids`: a first call, over no past, that computes positions
    `[0, end)` at least (`Media`), the smallest first chunk that does so and leaves the
    rest to calls (as `prefill_calls` splits it) that start at `end` or later. A chunk call
    must start at P - C or before, so after a first chunk longer than that the rest starts
    earlier and computes some of its rows again over a past: an image's rows among them
    would be computed causally and overwrite the first call's."""
    for size in sorted(f for f in L.first if f >= end):
        first = Call(0, min(size, n), size, True)
        rest = list(_gap_calls(first.end, n, L.prompt, (L.chunk, *L.bulk), (), L.first_dynamic)
                    if first.end < n else ())
        if all(call.begin >= end for call in rest):
            return [first, *rest]
    raise UsageError(
        f"this model lets an image's tokens attend each other both ways (token_type_ids) only in a prefill call "
        f"over no past, and the media end at position {end}: no first prefill chunk "
        f"({', '.join(map(str, L.first)) or 'none'}) holds them with the calls after it starting at or past "
        f"them (a chunk of {L.chunk} starts at {L.prompt - L.chunk} at the latest): compile with a first chunk "
        f"that holds them (--prefill-first) or an unchunked prefill (--prefill-chunk-size 0)")


def image_end_limit(L: LengthPlan) -> int:
    """The furthest position an image of a model that reads `token_type_ids` can end at in a
    prompt of P tokens (`media_calls`; a shorter prompt's first call may reach further): P
    with an unchunked prefill, else the most any first chunk F allows, F or where the calls
    after it start if earlier; 0 when no first chunk can hold one."""
    if not L.chunk:
        return L.prompt
    return max((min([f, *(call.begin for call in _gap_calls(f, L.prompt, L.prompt, (L.chunk, *L.bulk), (),
                                                            L.first_dynamic))])
                for f in L.first if f < L.prompt), default=0)


def _gap_calls(g0: int, g1: int, P: int, chunks: tuple[int, ...], firsts: tuple[int, ...], dynamic: bool = False):
    C = chunks[0]  # the others are multiples of it: a call starts on the gap's start, or a first chunk's end, + k * C
    inf = float("inf")
    for first in (g0, g0 - g0 % C):
        starts = set(range(first, g1, C))
        if first == 0:
            for f in firsts:
                starts.update(range(f, g1, C))
        cost, choice = {g1: 0}, {}
        for s in sorted(starts, reverse=True):
            best = inf
            options = [(f, True) for f in reversed(firsts)] if s == 0 else []
            for c, opens in options + [(c, False) for c in chunks if s <= P - c]:
                total = CALL_ROWS + (min(c, g1) if opens and dynamic else c) + cost[min(s + c, g1)]
                if total < best:
                    best, choice[s] = total, (c, opens)
            cost[s] = best
        if cost[first] < inf:
            break
    s = first
    while s < g1:
        c, opens = choice[s]
        yield Call(s, min(s + c, g1), c, opens)
        s = min(s + c, g1)


@dataclass
class Prefilled:
    """A prompt in the cache, its first token's logits not yet chosen from."""

    generation: StaticGeneration
    last: np.ndarray
    new_tokens: int
    shift: int = 0  # where generated tokens sit past their slots (`Media.shift`)
