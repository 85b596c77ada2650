"""Python's cyclic garbage collector, paused for kvc's allocation-heavy steps.

Reading an IR builds some 40 000 XML elements to validate it, and building a static pipeline
wraps some 10^5 OpenVINO objects in short-lived Python objects; none of them form cycles, yet
each allocation burst triggers collections that walk every live object. Pausing the collector
for those steps took 15-25% off their time (bench/static_bench.py work). It is switched back
on afterwards, so cycles made meanwhile are collected then.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
