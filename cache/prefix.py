"""Prefix caching over a static pipeline's KV buffers, with priority retention.

The rules (NPUW_LLM_ENABLE_PREFIX_CACHING for the blocks, REFERENCE.md §4; TensorRT-LLM's
KvCacheRetentionConfig for priorities, ../shared/seeds/002 and TensorRT-LLM's
docs/source/features/kvcache.md):

* A sequence is cut into blocks of `block_size` tokens from its start; only full blocks are
  cached. A block's key is ``sha256(parent key || its tokens as int64)``, chained from the
  first block, so equal keys mean equal sequences from position 0 (a cryptographic hash, as
  TensorRT-LLM requires of its block keys). A block holds the KV rows of its tokens, copied
  out of the pipeline's buffers.
* A vision-language prompt's image (`kvc.runtime.embeddings.Media`) gives its tokens rows that
  are not their ids' (an image's tokens share one id) and may give them positions that are not
  their slots (mRoPE). The sequence's `tags` (`Media.tags`: each token's image digest and
  position offsets) then enter the key of every block they are not all 0 in, after the
  tokens, as vLLM keys a block by its images' hashes: equal keys still mean equal rows. Such
  a block (`Block.media`) is never indexed for chunk reuse, and its stored event names it
  (`StoredBlock.media_key`).
* A lookup walks the chain from the first block and stops at the first miss.
* Capacity is a number of blocks (`max_blocks`, NPUW's MAX_NUM_BLOCKS) and optionally bytes.
  Making room evicts one *leaf* block at a time (a block with a cached child never goes
  before the child): the lowest priority first, then the least recently used.
* Priorities are 0-100 (default 35, TensorRT-LLM's). A request's `Retention` gives token
  ranges of its prompt a priority and optionally a duration, and the tokens its decode phase
  produces another. A block takes the highest priority of its tokens (a token no range covers
  has the default). A priority with a duration lapses to the default once the duration passes
  without the block being used; a block that is hit or stored again is used. A lapsed block
  keeps the default (TensorRT-LLM's eviction policy sets an expired block's priority to the
  default): the cache applies a lapse when it next stores, restores or touches blocks (an
  `updated` event when the priority changes), and eviction counts it as lapsed meanwhile.
* Every stored, removed and re-prioritized block of a chain is an event (`kvc.cache.events`);
  chunk-reuse blocks are not.
* For chunk-level reuse (`kvc.cache.chunks`) every block is also indexed by its tokens alone
  (`content_key`), with the position it was computed at and its origin (the sequence that
  stored it and its start, so blocks stored together are known to be contiguous). Blocks
  computed after approximately reused rows are stored by `store_approximate` under their
  content key only, never a chained key: a prefix hit is always exact.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from kvc.cache.events import EventBuffer, KVCacheEvent, StoredBlock
from kvc.errors import UsageError

DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority
MIN_PRIORITY, MAX_PRIORITY = 0, 100
DEFAULT_MAX_BLOCKS = 128  # NPUW_LLM_PREFIX_CACHING_MAX_NUM_BLOCKS' default


def check_priority(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise UsageError(f"{what}: a priority is an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, found {value!r}")
    return value


def check_duration(value, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise UsageError(f"{what}: a duration is a number of seconds >= 0 (or none: never lapses), found {value!r}")
    return float(value)


@dataclass(frozen=True)
class TokenRange:
    """Prompt tokens `[start, end)` (end None: to the end of the prompt) kept at `priority`
    for `duration` seconds without use (None: never lapses)."""

    start: int
    end: int | None
    priority: int
    duration: float | None = None

    def __post_init__(self) -> None:
        check_priority(self.priority, f"token range {self}")
        check_duration(self.duration, f"token range {self}")
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise UsageError(f"a token range starts at a token index >= 0, found {self.start!r}")
        if self.end is not None and (isinstance(self.end, bool) or not isinstance(self.end, int)
                                     or self.end <= self.start):
            raise UsageError(f"token range [{self.start}, {self.end!r}): the end must be an index after the start")

    def __str__(self) -> str:
        """`[start, end)`, or without an end `from start to the prompt's end` (messages printed
        `[50, None)`)."""
        return f"from {self.start} to the prompt's end" if self.end is None else f"[{self.start}, {self.end})"


@dataclass(frozen=True)
class Retention:
    """How long a request's blocks should stay: ranges of its prompt, and its decode phase."""

    ranges: tuple[TokenRange, ...] = ()
    decode_priority: int | None = None
    decode_duration: float | None = None

    def __post_init__(self) -> None:
        if self.decode_priority is not None:
            check_priority(self.decode_priority, "decode priority")
        check_duration(self.decode_duration, "decode duration")
        if self.decode_duration is not None and self.decode_priority is None:
            raise UsageError("a decode duration needs a decode priority (the duration is how long that priority "
                             "lasts)")

    def check(self, prompt_len: int) -> None:
        """Refuse ranges that fall outside a prompt of `prompt_len` tokens."""
        for r in self.ranges:
            if r.start >= prompt_len or (r.end is not None and r.end > prompt_len):
                raise UsageError(f"token range {r} is outside the {prompt_len}-token prompt")

    def of_token(self, index: int, prompt_len: int) -> tuple[int, float | None] | None:
        """The (priority, duration) this retention gives token `index`, None when it says nothing."""
        if index >= prompt_len:
            return None if self.decode_priority is None else (self.decode_priority, self.decode_duration)
        best = None
        for r in self.ranges:
            if r.start <= index < (prompt_len if r.end is None else r.end):
                if best is None or r.priority > best[0]:
                    best = (r.priority, r.duration)
        return best


@dataclass
class Block:
    key: str
    parent: str | None
    tokens: tuple[int, ...]
    rows: dict[str, np.ndarray]
    nbytes: int
    priority: int
    duration: float | None
    last_used: float
    children: int = 0
    origin: tuple[int, int] = (0, 0)  # (sequence number, start): blocks stored by one sequence are contiguous
    exact: bool = True  # False: a chunk-reuse block, computed in a context that was itself approximate
    media: str | None = None  # the digest of its tags (an image's tokens, mRoPE offsets) where its key holds them

    @property
    def start(self) -> int:
        """The position of its first token where its rows were computed."""
        return self.origin[1]

    def lapsed(self, now: float) -> bool:
        """Whether its priority's duration has passed without use."""
        return self.duration is not None and now - self.last_used > self.duration

    def effective_priority(self, now: float) -> int:
        return DEFAULT_PRIORITY if self.lapsed(now) else self.priority


def _token_hash(prefix: bytes, tokens: Iterable[int], extra: bytes = b"") -> str:
    digest = hashlib.sha256(prefix)
    digest.update(np.asarray(list(tokens), dtype="<i8").tobytes())
    digest.update(extra)
    return digest.hexdigest()


def block_tags(tags: np.ndarray | None, start: int, size: int) -> bytes:
    """What the key of the block of `size` tokens at `start` holds besides its tokens: its rows
    of `tags` (`kvc.cache.serving.sequence_tags`: `Media.tags`, LongRoPE's side) where any is
    not 0, else nothing (the key of its tokens alone)."""
    if tags is None:
        return b""
    block = np.ascontiguousarray(tags[start:start + size], "<i8")
    return block.tobytes() if block.any() else b""


def content_key(tokens: Iterable[int]) -> str:
    """The key of a block's tokens alone, wherever they stood (chunk-level reuse): a hash in
    its own domain, so it never equals a chained key."""
    return _token_hash(b"kvc-chunk\0", tokens)


def block_key(parent: str | None, tokens: Iterable[int], extra: bytes = b"") -> str:
    return _token_hash(bytes.fromhex(parent) if parent else b"", tokens, extra)


@dataclass
class CacheStats:
    requests: int = 0
    prompt_tokens: int = 0  # tokens of the prompts looked up
    hit_tokens: int = 0  # of them, restored from the cache's chained blocks (a prefix hit)
    stored_blocks: int = 0  # chained blocks: the `stored` and `removed` events' blocks
    evicted_blocks: int = 0
    chunk_stored_blocks: int = 0  # chunk-reuse blocks (`store_approximate`): no events
    chunk_evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
                "hit_rate": self.hit_rate, "stored_blocks": self.stored_blocks,
                "evicted_blocks": self.evicted_blocks, "chunk_stored_blocks": self.chunk_stored_blocks,
                "chunk_evicted_blocks": self.chunk_evicted_blocks}


@dataclass
class PrefixCache:
    """Blocks of KV rows keyed by chained token hashes (see the module docstring)."""

    block_size: int
    max_blocks: int = DEFAULT_MAX_BLOCKS
    max_bytes: int | None = None
    event_buffer_size: int = 0
    clock: Callable[[], float] = time.monotonic
    policy: str = "priority"  # "lru": priorities ignored (the baseline retention is measured against)
    blocks: dict[str, Block] = field(default_factory=dict, init=False)
    stats: CacheStats = field(default_factory=CacheStats, init=False)
    by_content: dict[str, dict[str, None]] = field(default_factory=dict, init=False)  # content key -> block keys
    sequences: int = field(default=0, init=False)  # sequences stored so far (block origins)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise UsageError(f"the prefix-caching block size must be >= 1, got {self.block_size}")
        if self.max_blocks < 1:
            raise UsageError(f"the prefix cache must hold at least 1 block, got {self.max_blocks}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise UsageError(f"the prefix cache's byte capacity must be >= 1, got {self.max_bytes}")
        if self.policy not in ("priority", "lru"):
            raise UsageError(f"unknown retention policy {self.policy!r}: priority or lru")
        self.events = EventBuffer(self.event_buffer_size)
        self.bytes_used = 0

    # -- lookups ---------------------------------------------------------------------------
    def chain(self, tokens, count: int, tags: np.ndarray | None = None):
        """The chained keys of the full blocks of `tokens[:count]` (with their `tags`), in order."""
        parent, B = None, self.block_size
        for start in range(0, count - B + 1, B):
            parent = block_key(parent, tokens[start:start + B], block_tags(tags, start, B))
            yield parent

    def lookup(self, tokens, limit: int, tags: np.ndarray | None = None) -> list[Block]:
        """The cached blocks that begin `tokens` (with their `tags`), in order, covering at
        most `limit` tokens."""
        found = []
        for key in self.chain(tokens, limit, tags):
            block = self.blocks.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def find_chunk(self, tokens, after: tuple[int, int] | None = None) -> Block | None:
        """A cached block holding exactly `tokens`, computed anywhere: the one that continues
        the block of origin `after` when there is one (no seam between them), else the most
        recently used."""
        keys = self.by_content.get(content_key(tokens))
        if not keys:
            return None
        found = [self.blocks[k] for k in keys]
        if after is not None:
            follow = (after[0], after[1] + self.block_size)
            for block in found:
                if block.origin == follow:
                    return block
        return max(found, key=lambda b: b.last_used)

    def record_lookup(self, prompt_len: int, hit: int) -> None:
        self.stats.requests += 1
        self.stats.prompt_tokens += prompt_len
        self.stats.hit_tokens += hit

    # -- stores ----------------------------------------------------------------------------
    def store(self, tokens, count: int, rows_of: Callable[[int, int], dict[str, np.ndarray]],
              retention: Retention | None = None, prompt_len: int | None = None,
              tags: np.ndarray | None = None) -> int:
        """Cache the full blocks of `tokens[:count]` (whose KV rows `rows_of(start, stop)`
        copies; `tags`: the sequence's, `Media.tags`); blocks already cached are used (and
        re-prioritized when `retention` says so). Returns the number of blocks added; it stops
        at the first block that finds no room. `prompt_len` tells prompt tokens from decoded
        ones (default: all are prompt)."""
        B, now, parent, added = self.block_size, self.clock(), None, 0
        self._lapse(now)
        prompt_len = count if prompt_len is None else prompt_len
        self.sequences += 1
        chain: set[str] = set()
        stored: list[StoredBlock] = []
        stored_parent = None
        for start in range(0, count - B + 1, B):
            span = tuple(int(t) for t in tokens[start:start + B])
            extra = block_tags(tags, start, B)
            key = block_key(parent, span, extra)
            priority, duration, explicit = self._priority(start, retention, prompt_len)
            block = self.blocks.get(key)
            if block is not None:
                self._flush_stored(stored_parent, stored)
                stored, stored_parent = [], key
                self._use(block, now, (priority, duration) if explicit else None)
            else:
                rows = rows_of(start, start + B)
                nbytes = sum(a.nbytes for a in rows.values())
                if not self._make_room(nbytes, chain | {parent} if parent else chain):
                    break
                media = hashlib.sha256(extra).hexdigest() if extra else None
                block = Block(key, parent, span, rows, nbytes, priority, duration, now,
                              origin=(self.sequences, start), media=media)
                self._add(block)
                if parent is not None:
                    self.blocks[parent].children += 1
                stored.append(StoredBlock(key, span, priority, media))
                self.stats.stored_blocks += 1
                added += 1
            chain.add(key)
            parent = key
        self._flush_stored(stored_parent, stored)
        return added

    def store_approximate(self, tokens, start: int, count: int,
                          rows_of: Callable[[int, int], dict[str, np.ndarray]]) -> int:
        """Cache the full blocks of `tokens[start:count]` (`start` a block boundary) for
        chunk-level reuse only: their rows were computed after rows reused from another
        context, so no chained key may name them. A block whose tokens are cached already is
        skipped; the request's own exact blocks (the chain of `tokens[:start]`) are never
        evicted for them. They are no events: a content key names no prefix, and a consumer
        of the stream (TensorRT-LLM's KVCacheEvent: a stored block without a parent begins a
        sequence) would take each for a first block. Returns the number of blocks added."""
        B, now, added = self.block_size, self.clock(), 0
        self._lapse(now)
        self.sequences += 1
        chain = set(self.chain(tokens, start))
        for at in range(start, count - B + 1, B):
            span = tuple(int(t) for t in tokens[at:at + B])
            key = content_key(span)
            if self.by_content.get(key):
                continue
            rows = rows_of(at, at + B)
            nbytes = sum(a.nbytes for a in rows.values())
            if not self._make_room(nbytes, chain):
                break
            block = Block(key, None, span, rows, nbytes, DEFAULT_PRIORITY, None, now,
                          origin=(self.sequences, at), exact=False)
            self._add(block)
            self.stats.chunk_stored_blocks += 1
            added += 1
        return added

    def _add(self, block: Block) -> None:
        self.blocks[block.key] = block
        self.bytes_used += block.nbytes
        if block.media is None:  # a block of an image is not its ids' rows: no chunk reuse finds it
            self.by_content.setdefault(content_key(block.tokens), {})[block.key] = None

    def use(self, blocks: list[Block], retention: Retention | None = None, prompt_len: int | None = None) -> None:
        """Mark restored blocks used now (their priority clocks restart); with a retention
        that gives them a priority, take it."""
        now = self.clock()
        self._lapse(now)
        for i, block in enumerate(blocks):
            priority, duration, explicit = self._priority(i * self.block_size, retention,
                                                          prompt_len if prompt_len is not None else 1 << 62)
            self._use(block, now, (priority, duration) if explicit else None)

    def touch(self, block: Block) -> None:
        """Mark a block used now (a chunk-reuse hit), its priority unchanged."""
        now = self.clock()
        self._lapse(now)
        self._use(block, now, None)

    def _lapse(self, now: float) -> None:
        """Give every block whose priority lapsed (`Block.lapsed`) the default priority for good,
        as TensorRT-LLM's eviction policy does when a block's priority expires: a later hit
        restarted the clock of the old priority, which came back for another duration. An
        `updated` event when that changes the priority (a chunk-reuse block has the default)."""
        for block in self.blocks.values():
            if block.lapsed(now):
                old, block.priority, block.duration = block.priority, DEFAULT_PRIORITY, None
                if old != DEFAULT_PRIORITY:
                    self.events.emit("updated", block_hashes=(block.key,), priority=DEFAULT_PRIORITY)

    def _use(self, block: Block, now: float, set_priority: tuple[int, float | None] | None) -> None:
        block.last_used = now
        if set_priority is not None and (block.priority, block.duration) != set_priority:
            block.priority, block.duration = set_priority
            self.events.emit("updated", block_hashes=(block.key,), priority=block.priority)

    def _flush_stored(self, parent: str | None, stored: list[StoredBlock]) -> None:
        if stored:
            self.events.emit("stored", parent_hash=parent, blocks=tuple(stored))

    def _priority(self, start: int, retention: Retention | None, prompt_len: int) -> tuple[int, float | None, bool]:
        """(priority, duration, whether the retention set it) of the block starting at `start`."""
        best = None
        if retention is not None:
            for i in range(start, start + self.block_size):
                got = retention.of_token(i, prompt_len)
                if got is not None and (best is None or got[0] > best[0]):
                    best = got
        if best is None:
            return DEFAULT_PRIORITY, None, False
        return best[0], best[1], True

    # -- eviction --------------------------------------------------------------------------
    def _make_room(self, nbytes: int, protected: set[str]) -> bool:
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return False
        while (len(self.blocks) + 1 > self.max_blocks
               or (self.max_bytes is not None and self.bytes_used + nbytes > self.max_bytes)):
            victim = self._victim(protected)
            if victim is None:
                return False
            self._remove(victim)
        return True

    def _victim(self, protected: set[str]) -> Block | None:
        now, best, best_rank = self.clock(), None, None
        for block in self.blocks.values():
            if block.children or block.key in protected:
                continue
            rank = (block.effective_priority(now) if self.policy == "priority" else 0, block.last_used)
            if best_rank is None or rank < best_rank:
                best, best_rank = block, rank
        return best

    def _remove(self, block: Block) -> None:
        del self.blocks[block.key]
        self.bytes_used -= block.nbytes
        if block.media is None:
            ck = content_key(block.tokens)
            self.by_content[ck].pop(block.key, None)
            if not self.by_content[ck]:
                del self.by_content[ck]
        if block.parent is not None and block.parent in self.blocks:
            self.blocks[block.parent].children -= 1
        if block.exact:
            self.stats.evicted_blocks += 1
            self.events.emit("removed", block_hashes=(block.key,))
        else:  # a chunk-reuse block was no event (`store_approximate`)
            self.stats.chunk_evicted_blocks += 1

    def clear(self) -> None:
        """Evict every block (leaves first, so each removal event names a leaf)."""
        while self.blocks:
            self._remove(next(b for b in self.blocks.values() if not b.children))

    # -- views -----------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Every block's key, chunk-reuse blocks' too."""
        return list(self.blocks)

    def chain_keys(self) -> list[str]:
        """The chained blocks' keys: the set a replay of the events gives."""
        return [k for k, b in self.blocks.items() if b.exact]

    def chunk_keys(self) -> list[str]:
        """The chunk-reuse blocks' (content) keys, which are no events (`store_approximate`)."""
        return [k for k, b in self.blocks.items() if not b.exact]

    def get_latest_events(self, timeout: float | None = 0.0) -> list[KVCacheEvent]:
        return self.events.get_latest_events(timeout)
