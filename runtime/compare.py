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
    """Logit metrics over the steps both runs share up to the first divergent token (after
    it the two runs condition on different tokens, so their logits are not comparable)."""

    max_abs: float
    nrmse: float
    top1: float
    first_divergent_token: int | None
    steps: int
    margin_at_divergence: float | None = None  # reference top-1 minus top-2 logit there

    def to_dict(self) -> dict:
        return asdict(self)


def compare_generations(ref, actual) -> Comparison:
    """Compare two `Generation`s: per-step logits and the token streams."""
    div = first_divergence(ref.tokens, actual.tokens)
    steps = min(len(ref.logits), len(actual.logits), (div + 1) if div is not None else len(ref.logits))
    if not steps:
        return Comparison(0.0, 0.0, 1.0, div, 0)
    r, a = np.stack(ref.logits[:steps]), np.stack(actual.logits[:steps])
    m = margin(ref.logits[div]) if div is not None and div < len(ref.logits) else None
    return Comparison(max_abs(r, a), nrmse(r, a), top1_agreement(r, a), div, steps, m)


# REFERENCE.md §7: f32 paths compare logits at 1e-4; f16 paths by NPUW's NRMSE bound and top-1.
F32_ATOL = 1e-4
F16_NRMSE = 0.01


@dataclass(frozen=True)
class Verdict:
    ok: bool
    comparison: Comparison
    reason: str

    def to_dict(self) -> dict:
        return {"ok": self.ok, "reason": self.reason, **self.comparison.to_dict()}


def judge(ref, actual, *, f16: bool = False) -> Verdict:
    """Whether `actual` reproduces `ref`.

    f32 paths: identical tokens and logits within 1e-4. f16 paths: NRMSE ≤ 0.01, and a token
    may differ only where the reference's top-1/top-2 margin is within twice the logit error
    seen up to that step (a near-tie that f16 rounding can flip); such a divergence is
    reported, never hidden.
    """
    c = compare_generations(ref, actual)
    div = c.first_divergent_token
    if not f16:
        if div is not None:
            return Verdict(False, c, f"token {div} differs (reference margin {c.margin_at_divergence:.4g})")
        if c.max_abs > F32_ATOL:
            return Verdict(False, c, f"logits differ by {c.max_abs:.3g} > {F32_ATOL}")
        return Verdict(True, c, "identical tokens, logits within 1e-4")
    if c.nrmse > F16_NRMSE:
        return Verdict(False, c, f"NRMSE {c.nrmse:.3g} > {F16_NRMSE}")
    if div is not None:
        # The error seen up to and including the divergent step (same context until there).
        error = c.max_abs
        if c.margin_at_divergence is not None and c.margin_at_divergence > 2 * max(error, 1e-3):
            return Verdict(False, c, f"token {div} differs with reference margin {c.margin_at_divergence:.4g} "
                                     f"above twice the f16 logit error {error:.3g}")
        return Verdict(True, c, f"token {div} differs at a near-tie (margin {c.margin_at_divergence:.3g}, "
                                f"f16 logit error {error:.3g})")
    return Verdict(True, c, f"identical tokens, NRMSE {c.nrmse:.3g}")
