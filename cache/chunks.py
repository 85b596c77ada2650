"""Chunk-level reuse of KV rows beyond the prefix (KVBoost, ../shared/seeds/003).

A prompt such as ``instruction + documents in any order + question`` shares with earlier
prompts documents that stand at other positions after other text; the prefix cache stops at
the first block that differs. Chunk reuse goes on past it:

* The prompt is cut into the prefix cache's blocks (from position 0). Each full block after
  the exact prefix (and before the last prompt token) is looked up by its tokens alone
  (`PrefixCache.find_chunk`); a hit's rows are moved from the position they were computed at
  to this one (`kvc.cache.moves`: keys re-rotated, or unchanged where the model has no
  position in them; models whose keys cannot be moved are refused when reuse is enabled).
* A *seam* is a hit whose block does not continue the block before it as stored (the
  previous block was computed here, or came from another place or sequence). From a seam
  the first `repair` tokens are recomputed with the real context before them (KVBoost's
  selective recompute; a repair longer than a block goes on into the blocks that continue
  it); the rest of the rows of the seam's block and of every following block that continues
  it are placed as moved. On a static pipeline a recomputed span costs one prefill
  chunk call whatever its length up to the chunk, so the default repair is one chunk; a
  repair as long as the reused text recomputes it all (the uncached output).
* Everything else is computed, chunk by chunk, over all rows before it.

The result is approximate: the placed rows were computed in another context. Nothing hides
that: `StaticGeneration.placed_tokens` (reported as `approximate_tokens`) counts them, and the
rows of a request from its first placed block on are stored for chunk reuse only, never under
a chained key, so a prefix hit stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvc.cache.moves import Mover
from kvc.cache.prefix import Block, PrefixCache
from kvc.errors import UsageError


@dataclass(frozen=True)
class ChunkReuse:
    """How to reuse chunks: the row mover calibrated for the model, and the tokens recomputed
    after each seam (None: one prefill chunk)."""

    mover: Mover
    repair: int | None = None

    def __post_init__(self) -> None:
        if self.repair is not None and (isinstance(self.repair, bool) or not isinstance(self.repair, int)
                                        or self.repair < 0):
            raise UsageError(f"the chunk-reuse repair must be a number of tokens >= 0, got {self.repair!r}")


@dataclass
class ChunkPlan:
    placed: list[tuple[int, dict[str, np.ndarray]]]  # (position, moved rows) for the pipeline
    blocks: list[Block]  # the cache blocks used
    first: int | None  # the start of the first block rows were placed in, None when none were


def plan_chunks(cache: PrefixCache, reuse: ChunkReuse, prompt, start: int, chunk: int, seq_axes: dict[str, int],
                after: tuple[int, int] | None) -> ChunkPlan:
    """The blocks of `prompt` from `start` (a block boundary after the exact prefix) that can
    be placed, with their moved rows (module docstring). `after`: the origin of the block
    just before `start` (None: computed here or none)."""
    B = cache.block_size
    repair = chunk if reuse.repair is None else reuse.repair
    n = len(prompt)
    plan = ChunkPlan([], [], None)
    left = 0  # tokens of the current seam's repair still to recompute
    for s in range(start, n - 1 - B + 1, B):  # the last prompt token is always computed
        block = cache.find_chunk(prompt[s:s + B], after)
        if block is None:
            after = None
            continue
        seam = after is None or block.origin != (after[0], after[1] + B)
        if seam:
            left = repair
        skip = min(left, B)
        left -= skip
        after = block.origin
        if skip == B:  # recomputed whole: part of the repair
            continue
        moved = reuse.mover.move(block.rows, s - block.start)
        rows = {name: take_rows(a, seq_axes[name], skip, B) for name, a in moved.items()}
        plan.placed.append((s + skip, rows))
        plan.blocks.append(block)
        if plan.first is None:
            plan.first = s
    return plan


def take_rows(a: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    """Rows `[start:stop]` of `a` along its sequence axis (a view)."""
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop)
    return a[tuple(index)]
