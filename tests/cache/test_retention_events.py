"""The prefix cache's bookkeeping without a model: eviction order, priorities and their decay,
byte capacity, and the event stream a router would replay."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from kvc.cache.prefix import DEFAULT_PRIORITY, PrefixCache, Retention, TokenRange, block_key
from kvc.errors import UsageError

B = 4


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def rows_of(start, stop):
    """Fake KV rows: 8 bytes a token, so byte capacities are easy to state."""
    return {"past.0": np.arange(start, stop, dtype=np.float64)}


def store(cache, tokens, retention=None, prompt_len=None):
    return cache.store(tokens, len(tokens), rows_of, retention, prompt_len)


def test_keys_chain_over_the_parent_and_the_tokens():
    first = block_key(None, [1, 2, 3, 4])
    assert block_key(first, [5, 6, 7, 8]) != block_key(None, [5, 6, 7, 8])
    assert block_key(first, [5, 6, 7, 8]) == block_key(block_key(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    cache = PrefixCache(B, max_blocks=10)
    store(cache, list(range(1, 11)))  # 10 tokens: two full blocks, the rest is not cached
    assert cache.keys() == [first, block_key(first, [5, 6, 7, 8])]
    assert [b.rows["past.0"].tolist() for b in cache.blocks.values()] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(cache.lookup(list(range(1, 11)), 9)) == 2 and len(cache.lookup(list(range(1, 11)), 7)) == 1
    assert cache.lookup([9] + list(range(2, 11)), 9) == []  # a different first token misses everything


def test_eviction_takes_leaves_lowest_priority_then_least_recently_used():
    clock = Clock()
    cache = PrefixCache(B, max_blocks=4, clock=clock)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    store(cache, system + [10, 11, 12, 13], Retention((TokenRange(0, 8, 100),)), 12)  # s0 s1 (100) u (35)
    clock.now = 1
    store(cache, [20, 21, 22, 23])  # x (35), used later than u
    assert len(cache.blocks) == 4
    clock.now = 2
    store(cache, [30, 31, 32, 33])  # needs room: u and x are leaves at 35; u is older
    s0 = block_key(None, system[:4])
    s1 = block_key(s0, system[4:])
    assert set(cache.keys()) == {s0, s1, block_key(None, [20, 21, 22, 23]), block_key(None, [30, 31, 32, 33])}
    clock.now = 3
    store(cache, [40, 41, 42, 43], Retention((), decode_priority=0), 0)  # all decode tokens: priority 0
    store(cache, [50, 51, 52, 53])  # the priority-0 block goes first, though it is the newest
    assert block_key(None, [40, 41, 42, 43]) not in cache.blocks
    # s1 is a leaf now but at 100: the 35s go before it, and s0 (its parent) never goes before s1
    for t in range(60, 64):
        store(cache, [t, t, t, t])
    assert {s0, s1} <= set(cache.keys())


def test_a_parent_is_never_evicted_before_its_child():
    cache = PrefixCache(B, max_blocks=3)
    store(cache, list(range(12)))  # a chain of three
    store(cache, [100, 101, 102, 103])
    keys = cache.keys()
    assert len(keys) == 3 and block_key(None, range(4)) in keys  # the chain lost its leaf, not its root
    assert all(cache.blocks[b.parent].children for b in cache.blocks.values() if b.parent)


def test_a_priority_lapses_to_the_default_when_its_duration_passes_without_use():
    clock = Clock()
    cache = PrefixCache(B, max_blocks=2, clock=clock)
    store(cache, [1, 2, 3, 4], Retention((TokenRange(0, None, 90, duration=10.0),)), 4)
    clock.now = 1
    store(cache, [5, 6, 7, 8])  # default priority, newer
    block = cache.blocks[block_key(None, [1, 2, 3, 4])]
    clock.now = 9
    cache.use(cache.lookup([1, 2, 3, 4, 0], 4))  # a hit restarts the clock
    clock.now = 18
    assert block.effective_priority(clock.now) == 90
    store(cache, [9, 9, 9, 9])  # evicts [5..8] (35) rather than the 90 block
    assert block.key in cache.blocks
    clock.now = 30  # 21 s without use: back to the default, and the oldest: it goes now
    assert block.effective_priority(clock.now) == DEFAULT_PRIORITY
    store(cache, [8, 8, 8, 8])
    assert block.key not in cache.blocks


def test_a_lapsed_priority_stays_lapsed_and_says_so():
    """A lapse was computed when eviction looked and never stored: a later plain hit restarted
    the clock, the old priority came back for another duration (a block at 90 outlived newer
    blocks at the default), and no event ever said it had lapsed. Now a lapsed block takes the
    default for good, as TensorRT-LLM's eviction policy sets it, with an `updated` event."""
    clock = Clock()
    cache = PrefixCache(B, max_blocks=2, clock=clock, event_buffer_size=100)
    store(cache, [1, 2, 3, 4], Retention((TokenRange(0, None, 90, duration=10.0),)), 4)
    block = cache.blocks[block_key(None, [1, 2, 3, 4])]
    cache.get_latest_events()
    clock.now = 20  # lapsed at 10
    cache.use(cache.lookup([1, 2, 3, 4, 0], 4))  # a plain hit
    assert (block.priority, block.duration) == (DEFAULT_PRIORITY, None)
    assert [(e.type, e.block_hashes, e.priority) for e in cache.get_latest_events()] == [
        ("updated", (block.key,), DEFAULT_PRIORITY)]
    clock.now = 21
    store(cache, [5, 6, 7, 8])  # the default, used after the lapsed block
    assert block.effective_priority(clock.now) == DEFAULT_PRIORITY  # was 90 again: the hit restarted its clock
    clock.now = 22
    store(cache, [9, 9, 9, 9])  # the least recently used of two defaults goes
    assert block.key not in cache.blocks and block_key(None, [5, 6, 7, 8]) in cache.blocks
    # a priority equal to the default lapses without an event; a request may set one again
    store(cache, [7, 7, 7, 7], Retention((TokenRange(0, None, DEFAULT_PRIORITY, duration=1.0),)), 4)
    cache.get_latest_events()
    clock.now = 30
    again = cache.lookup([7, 7, 7, 7, 0], 4)
    cache.use(again)
    assert again[0].duration is None and cache.get_latest_events() == []
    cache.use(again, Retention((TokenRange(0, None, 60),)), 5)
    assert [(e.type, e.priority) for e in cache.get_latest_events()] == [("updated", 60)]


def test_lru_policy_ignores_priorities():
    clock = Clock()
    cache = PrefixCache(B, max_blocks=1, clock=clock, policy="lru")
    store(cache, [1, 2, 3, 4], Retention((TokenRange(0, None, 100),)), 4)
    clock.now = 1
    store(cache, [5, 6, 7, 8])
    assert cache.keys() == [block_key(None, [5, 6, 7, 8])]


def test_byte_capacity():
    cache = PrefixCache(B, max_blocks=100, max_bytes=3 * 4 * 8)  # three blocks of four 8-byte rows
    store(cache, list(range(20)))  # five blocks wanted: the chain stops when only its own blocks remain
    assert len(cache.blocks) == 3 and cache.bytes_used == 96
    assert PrefixCache(B, max_bytes=8).store(list(range(4)), 4, rows_of) == 0  # a block larger than the cache


def test_a_block_takes_the_highest_priority_of_its_tokens_and_decode_tokens_get_theirs():
    cache = PrefixCache(B, max_blocks=10)
    retention = Retention((TokenRange(0, 2, 80), TokenRange(2, 6, 20)), decode_priority=5)
    store(cache, list(range(12)), retention, prompt_len=6)
    assert [b.priority for b in cache.blocks.values()] == [80, 20, 5]  # [0,4): 80; [4,8): 20 and 5; [8,12): 5


def test_bad_retention_is_refused():
    with pytest.raises(UsageError, match="priority is an integer from 0 to 100, found 101"):
        TokenRange(0, 4, 101)
    with pytest.raises(UsageError, match="priority is an integer from 0 to 100, found -1"):
        Retention(decode_priority=-1)
    with pytest.raises(UsageError, match="the end must be an index after the start"):
        TokenRange(4, 4, 50)
    with pytest.raises(UsageError, match=r"token range \[2, 9\) is outside the 8-token prompt"):
        Retention((TokenRange(2, 9, 50),)).check(8)
    with pytest.raises(UsageError, match="token range from 50 to the prompt's end is outside the 4-token prompt"):
        Retention((TokenRange(50, None, 50),)).check(4)  # printed [50, None)
    with pytest.raises(UsageError, match="a decode duration needs a decode priority"):
        Retention((TokenRange(0, 4, 50),), decode_duration=1.0)  # was kept, and never used


def test_events_replayed_by_a_router_give_the_cache_s_blocks():
    """A long random workload with evictions, re-prioritizations and lapses: the set a router
    builds from the events equals the cache's own, and each stored block names its parent."""
    clock, rng = Clock(), random.Random(7)
    cache = PrefixCache(B, max_blocks=12, max_bytes=40 * 8, event_buffer_size=100_000, clock=clock)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(6)]
    view: dict[str, int] = {}
    last_id = -1
    for step in range(600):
        clock.now += rng.random()
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(12))]
        retention = None
        if rng.random() < 0.4:
            retention = Retention((TokenRange(0, rng.randrange(1, len(tokens) + 1), rng.randrange(101),
                                              rng.choice([None, 2.0, 20.0])),),
                                  decode_priority=rng.choice([None, 0, 99]))
        hit = cache.lookup(tokens, len(tokens) - 1)
        cache.use(hit, retention, len(tokens))
        store(cache, tokens, retention, len(tokens) - rng.randrange(3))
        if step % 7 == 0:  # a router polls now and then
            for event in cache.get_latest_events():
                assert event.event_id == last_id + 1
                last_id = event.event_id
                if event.type == "stored":
                    assert event.parent_hash is None or event.parent_hash in view
                    for block in event.blocks:
                        view[block.block_hash] = block.priority
                elif event.type == "removed":
                    for key in event.block_hashes:
                        del view[key]
                else:
                    view[event.block_hashes[0]] = event.priority
    for event in cache.get_latest_events():
        if event.type == "stored":
            view.update((b.block_hash, b.priority) for b in event.blocks)
        elif event.type == "removed":
            for key in event.block_hashes:
                del view[key]
        else:
            view[event.block_hashes[0]] = event.priority
    assert view == {k: b.priority for k, b in cache.blocks.items()}
    assert cache.stats.evicted_blocks > 50 and cache.stats.stored_blocks > 50


def test_the_event_buffer_is_bounded_and_waits_for_events():
    cache = PrefixCache(B, max_blocks=100, event_buffer_size=3)
    for i in range(5):
        store(cache, [i] * B)
    events = cache.get_latest_events()
    assert [e.event_id for e in events] == [2, 3, 4]  # the oldest were dropped; the ids show the gap
    assert cache.get_latest_events() == []
    started = time.monotonic()
    assert cache.get_latest_events(timeout=0.2) == [] and time.monotonic() - started >= 0.19
    threading.Timer(0.1, lambda: store(cache, [9] * B)).start()
    got = cache.get_latest_events(timeout=5)
    assert [e.type for e in got] == ["stored"]
    assert PrefixCache(B).get_latest_events() == []  # size 0 (the default): no events kept
