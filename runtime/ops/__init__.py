"""Kernels of kvc's numpy interpreter, one module per op family (see `registry`)."""

from __future__ import annotations

import functools
import importlib

FAMILIES = ("elementwise", "reductions", "movement", "indexing", "linalg", "attention", "kvc_ops")


@functools.cache
def load_all() -> None:
    """Import every op family so their kernels are registered."""
    for family in FAMILIES:
        importlib.import_module(f"kvc.runtime.ops.{family}")
