"""Choosing the next token: greedy (the default, and what verification uses) or sampling as
openvino.genai and transformers do it, and stopping at the model's end-of-sequence ids.

Sampling, in order: logits / temperature; keep the `top_k` largest (0: all); softmax; keep the
smallest set of most likely tokens whose probability reaches `top_p` (1.0: all); renormalize
and draw with a generator seeded by `seed`, so the same seed gives the same tokens.
Temperature 0 is greedy (argmax; the first of equal maxima).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvc import jsontext
from kvc.errors import ComputeError, UsageError
from kvc.runtime.embeddings import language_config


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: frozenset[int] = field(default_factory=frozenset)  # generation ends after one of these
    finite: bool = True  # refuse logits no token can come from (`choosable`); False: `JUDGED`

    def __post_init__(self) -> None:
        if not (0 <= self.temperature < float("inf")):
            raise UsageError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"top-k must be >= 0 (0: every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**128:
            raise UsageError(f"seed must be a non-negative integer (below 2^128), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def chooser(self):
        """A function from a step's logits [V] to the next token id; it refuses logits no token
        can come from (`choosable`). Greedy takes the first of equal maxima."""
        check = choosable if self.finite else (lambda logits: logits)
        if self.greedy:
            return lambda logits: int(np.argmax(check(logits)))
        rng = np.random.default_rng(self.seed)
        return lambda logits: sample(check(logits), self, rng)


# Greedy without the finiteness check: for the runs a judge compares (kvc.runtime.compare),
# which reports a non-finite logit as a mismatch, with where it is, instead of stopping there.
JUDGED = Sampling(finite=False)


def choosable(logits: np.ndarray) -> np.ndarray:
    """`logits`, checked: a NaN or +Inf anywhere, or no finite logit, is a `ComputeError`. A
    NaN is not an answer: argmax would return its index (or the next one's) as a token, and
    a model with a NaN weight printed tokens from it with exit 0. -Inf (a masked token) is
    allowed. One max over the row (a NaN propagates through it): ~10 us for 32000 logits."""
    top = np.max(logits)
    if not np.isfinite(top):
        what = ("NaN" if np.isnan(top) else "+Inf") if top != -np.inf else "no finite logit (every one is -Inf)"
        raise ComputeError(f"the model computed {what} in the logits a token is chosen from: no token is output "
                           f"from them (`kvc verify OUT` checks the compiled models against their source)")
    return logits


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """A token drawn from softmax(logits / T) cut to the top k and the top-p nucleus. The
    largest logit is taken off before dividing by T: logits / 1e-310 overflowed to Inf, and
    Inf - Inf made the probabilities NaN (exit 1); a tiny T now samples the top token."""
    x = np.asarray(logits, dtype=np.float64)
    order = np.argsort(-x, kind="stable")
    if s.top_k:
        order = order[:s.top_k]
    with np.errstate(over="ignore"):  # a logit far below the top over a tiny T: -Inf, probability 0
        z = (x[order] - np.max(x[order])) / s.temperature
    p = np.exp(z)
    p /= p.sum()
    if s.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(p), s.top_p) + 1)
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(order[rng.choice(len(order), p=p)])


def eos_ids(directory: Path) -> frozenset[int]:
    """The end-of-sequence ids of a compiled (or optimum-intel) directory's
    generation_config.json, else its config.json (its language model's: `language_config`);
    empty when neither states one."""
    return config_ids(directory, "eos_token_id")


def config_ids(directory: Path, key: str) -> frozenset[int]:
    """The token ids `key` (eos_token_id, bos_token_id, pad_token_id) names in a directory's
    generation_config.json, else its config.json (its language model's: `language_config`);
    empty when neither states one."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = language_config(jsontext.loads(jsontext.read_text(Path(directory) / name))).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        ids = value if isinstance(value, list) else [value]
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
        if ids:
            return frozenset(ids)
    return frozenset()
