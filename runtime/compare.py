"""Comparison metrics for logits and token streams (REFERENCE.md §7)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


def max_abs(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def nrmse(ref, actual) -> float:
    """NPUW's accuracy metric: RMSE / max(1e-3, range(ref), range(actual))."""
    r, x = np.asarray(ref, np.float64), np.asarray(actual, np.float64)
    if r.shape != x.shape:
        raise ValueError(f"shapes differ: {r.shape} vs {x.shape}")
    if not r.size:
        return 0.0
    rmse = float(np.sqrt(np.mean((r - x) ** 2)))
    scale = max(1e-3, float(r.max() - r.min()), float(x.max() - x.min()))
    return rmse / scale


def top1_agreement(ref, actual) -> float:
    """Fraction of rows (last axis = vocabulary) whose argmax agrees."""
    r, x = np.asarray(ref), np.asarray(actual)
    return float(np.mean(np.argmax(r, -1) == np.argmax(x, -1)))


def first_divergence(ref_tokens, tokens) -> int | None:
    """Index of the first differing token (or the first missing one), None if identical."""
    for i, (a, b) in enumerate(zip(ref_tokens, tokens)):
        if a != b:
            return i
    if len(ref_tokens) != len(tokens):
        return min(len(ref_tokens), len(tokens))
    return None


def margin(logits) -> float:
    """Top-1 minus top-2 logit: how far a token is from flipping."""
    top = np.sort(np.asarray(logits, np.float64).reshape(-1))[-2:]
    return float(top[1] - top[0])


@dataclass(frozen=True)
class Comparison:
    max_abs: float
    nrmse: float
    top1: float
    first_divergent_token: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def compare_generations(ref, actual) -> Comparison:
    """Compare two `Generation`s: per-step logits and the token streams."""
    steps = min(len(ref.logits), len(actual.logits))
    r = np.stack(ref.logits[:steps]) if steps else np.zeros((0,))
    a = np.stack(actual.logits[:steps]) if steps else np.zeros((0,))
    return Comparison(max_abs(r, a), nrmse(r, a), top1_agreement(r, a) if steps else 1.0,
                      first_divergence(ref.tokens, actual.tokens))
