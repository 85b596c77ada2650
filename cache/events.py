"""KV cache events, as TensorRT-LLM's event API publishes them (../shared/seeds/002).

Every change to the set of cached blocks is an event: ``stored`` (blocks added, under a parent),
``removed`` (blocks evicted) and ``updated`` (a block's priority changed). Each has an id that
increases by one, so a consumer sees when it missed some. Replaying the events in order into
a set of block keys gives the cache's own set (an eventually consistent view, as a router
builds it); `EventBuffer` keeps at most `max_size` events, dropping the oldest first (a
consumer that falls behind sees a gap in the ids), and `get_latest_events` hands over and
clears what is buffered, waiting up to `timeout` seconds for the first one.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StoredBlock:
    """A block stored: its key, tokens and priority; `media_key`, for a block whose key holds
    more than its tokens (an image's tokens, mRoPE positions: `kvc.cache.prefix`), the digest
    of that part, so that a consumer tells it from a block of the same tokens as text."""

    block_hash: str
    tokens: tuple[int, ...]
    priority: int
    media_key: str | None = None

    def to_dict(self) -> dict:
        d = {"block_hash": self.block_hash, "tokens": list(self.tokens), "priority": self.priority}
        if self.media_key is not None:
            d["media_key"] = self.media_key
        return d


@dataclass(frozen=True)
class KVCacheEvent:
    """One change: `type` is "stored" (parent_hash, blocks), "removed" (block_hashes) or
    "updated" (block_hashes holds the one block, priority its new priority)."""

    event_id: int
    type: str
    parent_hash: str | None = None
    blocks: tuple[StoredBlock, ...] = ()
    block_hashes: tuple[str, ...] = ()
    priority: int | None = None

    def to_dict(self) -> dict:
        d: dict = {"event_id": self.event_id, "type": self.type}
        if self.type == "stored":
            d["parent_hash"] = self.parent_hash
            d["blocks"] = [b.to_dict() for b in self.blocks]
        else:
            d["block_hashes"] = list(self.block_hashes)
        if self.type == "updated":
            d["priority"] = self.priority
        return d


@dataclass
class EventBuffer:
    """A bounded buffer of events (max_size 0: events are not kept, as TensorRT-LLM's default)."""

    max_size: int = 0
    _events: collections.deque = field(init=False)
    _next_id: int = field(default=0, init=False)
    _ready: threading.Condition = field(default_factory=threading.Condition, init=False)

    def __post_init__(self) -> None:
        if self.max_size < 0:
            raise ValueError(f"the event buffer size must be >= 0, got {self.max_size}")
        self._events = collections.deque(maxlen=self.max_size or None)

    def emit(self, type: str, **data) -> None:
        with self._ready:
            event = KVCacheEvent(self._next_id, type, **data)
            self._next_id += 1
            if self.max_size:
                self._events.append(event)
                self._ready.notify_all()

    def get_latest_events(self, timeout: float | None = 0.0) -> list[KVCacheEvent]:
        """Every buffered event, oldest first, and clear the buffer. When it is empty, wait up
        to `timeout` seconds (None: until one arrives) and return [] if none did."""
        with self._ready:
            if not self._events and timeout != 0:
                self._ready.wait_for(lambda: bool(self._events), timeout)
            events = list(self._events)
            self._events.clear()
            return events
