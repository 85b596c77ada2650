"""Matrix products on kvc's numpy runtime; in the compile's check, the same however many
cores compute them.

OpenBLAS's result depends on how many threads it splits a product over: on an AMD EPYC (its
Haswell kernels) a [33, 64] @ [64, 256] product differs by 6e-6 between one thread and two.
`kvc compile` gave BLAS one thread while a device compile ran beside its check and two once
it ended, so a compile's recorded errors changed from run to run, and a compile that took its
blobs from the cache (no device compile) wrote another manifest than one that compiled them.

The rules, inside `pooled()` (the compile's check): BLAS has one thread, and a large
product is cut into blocks fixed by its shapes alone, which a pool of one thread per core
computes (numpy releases the GIL in BLAS). A 2-D product is cut into column blocks
(`column_blocks`); a stack of products (attention's heads) is split between its matrices,
each still one GEMM as numpy runs it. How many threads are free to run the blocks, and when,
changes only how long they take, and the pool's threads wait without spinning, unlike
OpenBLAS's, which beside a device compile took its core (BLAS's own two threads throughout:
the 250M Llama's compile 11.0 -> 12.9 s, five alternating rounds). Outside it (`kvc run`,
`kvc verify` on numpy) products are numpy's, on BLAS's threads as the process has them, fixed
while it runs: pooling a decode step's [1, 1024] @ [1024, 1024] products took 0.17 ms against
BLAS's two threads' 0.07 (a pool task costs some 40 us).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Below this many multiply-adds a product runs whole in the calling thread (on one BLAS thread,
# a [16, 1024] @ [1024, 1024] product took 0.55 ms, in two blocks on the pool 0.37).
MIN_WORK = 1 << 23
MIN_COLUMNS = 256  # a block narrower than this repacks its rows for too little work
MAX_BLOCKS = 16


def column_blocks(m: int, k: int, n: int) -> int:
    """How many column blocks an [m, k] @ [k, n] product is computed in: a function of the
    shapes only, so that its result is too."""
    if m * k * n < MIN_WORK:
        return 1
    return max(1, min(MAX_BLOCKS, n // MIN_COLUMNS))


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`np.matmul(a, b)` for 2-D or stacked operands (no 1-D); inside `pooled()`, in blocks on
    the pool."""
    if not _pooled:
        return np.matmul(a, b)
    if a.ndim == 2 and b.ndim == 2:
        m, k = a.shape
        n = b.shape[1]
        parts = column_blocks(m, k, n)
        if parts == 1:
            return a @ b
        out = np.empty((m, n), np.result_type(a, b))  # written in place: no second copy of a [521, 32000] logits
        _run([functools.partial(np.matmul, a, b[:, c], out=out[:, c]) for c in _cut(n, parts)])
        return out
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    axis = next((i for i, d in enumerate(lead) if d > 1), None)
    if axis is None or math.prod(lead) * a.shape[-2] * a.shape[-1] * b.shape[-1] < MIN_WORK:
        return np.matmul(a, b)
    a = np.broadcast_to(a, lead + a.shape[-2:])
    b = np.broadcast_to(b, lead + b.shape[-2:])
    cut = [(slice(None),) * axis + (c,) for c in _cut(lead[axis], min(lead[axis], MAX_BLOCKS))]
    out = np.empty(lead + (a.shape[-2], b.shape[-1]), np.result_type(a, b))
    _run([functools.partial(np.matmul, a[c], b[c], out=out[c]) for c in cut])
    return out


def _cut(size: int, parts: int) -> list[slice]:
    """`size` cut into `parts` slices of (nearly) equal length."""
    edges = [size * i // parts for i in range(parts + 1)]
    return [slice(lo, hi) for lo, hi in zip(edges, edges[1:])]


def _run(tasks) -> list[np.ndarray]:
    return [f.result() for f in [_pool().submit(t) for t in tasks]]


_pooled: list = []  # the `pooled()` now in force


@contextlib.contextmanager
def pooled():
    """Products computed as the module's rules say while it lasts: BLAS on one thread
    (threadpoolctl), given back after."""
    with _controller().limit(limits=1, user_api="blas"):
        _pooled.append(True)
        try:
            yield
        finally:
            _pooled.pop()


@functools.cache
def _pool() -> ThreadPoolExecutor:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ThreadPoolExecutor(max_workers=cores, thread_name_prefix="kvc-matmul")


@functools.cache
def _controller():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()  # scanning the loaded libraries takes 85 us; limiting then 6
