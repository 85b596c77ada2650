"""Choosing the next token: greedy (the default, and what verification uses) or sampling as
openvino.genai and transformers do it, and stopping at the model's end-of-sequence ids.

Sampling, in order: logits / temperature; keep the `top_k` largest (0: all); softmax; keep the
smallest set of most likely tokens whose probability reaches `top_p` (1.0: all); renormalize
and draw with a generator seeded by `seed`, so the same seed gives the same tokens.
Temperature 0 is greedy (argmax; the first of equal maxima).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvc.errors import UsageError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: frozenset[int] = field(default_factory=frozenset)  # generation ends after one of these

    def __post_init__(self) -> None:
        if not (0 <= self.temperature < float("inf")):
            raise UsageError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"top-k must be >= 0 (0: every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def chooser(self):
        """A function from a step's logits [V] to the next token id."""
        if self.greedy:
            return lambda logits: int(np.argmax(logits))
        rng = np.random.default_rng(self.seed)
        return lambda logits: sample(logits, self, rng)


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    x = np.asarray(logits, dtype=np.float64) / s.temperature
    if not np.isfinite(x).any():
        raise UsageError("cannot sample: every logit is NaN or -inf")
    order = np.argsort(-x, kind="stable")
    if s.top_k:
        order = order[:s.top_k]
    z = x[order] - np.max(x[order])
    p = np.exp(z)
    p /= p.sum()
    if s.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(p), s.top_p) + 1)
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(order[rng.choice(len(order), p=p)])


def eos_ids(directory: Path) -> frozenset[int]:
    """The end-of-sequence ids of a compiled (or optimum-intel) directory's
    generation_config.json, else its config.json; empty when neither states one."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((Path(directory) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids = value if isinstance(value, list) else [value]
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
        if ids:
            return frozenset(ids)
    return frozenset()
