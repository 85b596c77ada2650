"""Plain-text tables and JSON output shared by the commands."""

from __future__ import annotations

import json
import math
from typing import Iterable, Sequence

import click
import numpy as np


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces, with a rule under the header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def echo_json(data) -> None:
    """`data` as strict JSON: a NaN or an infinity (a metric of a run that computed them) is
    written as the string "NaN", "Infinity" or "-Infinity"; Python's bare NaN is not JSON,
    and `jq` and JSON.parse refused kvc bisect's report of a NaN source."""
    click.echo(json.dumps(_strict(data), indent=2, sort_keys=True, allow_nan=False))


def _strict(value):
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
