"""Comparison metrics for logits and token streams, and the verdict policy
(docs/verification.md states it with its reasoning; REFERENCE.md §7 the peers' tolerances).

The policy, in order:

1. **Non-finite values.** A NaN or +Inf logit is always a failure, even where the reference
   holds the same: no model computes them on purpose, and a source model that does (NaN
   weights, say) has nothing to be verified against. A -Inf (a masked vocabulary entry) is a
   mismatch unless the reference holds it at the same place. The metrics below are computed
   over the finite positions only and never decide alone: NaN compares False with
   everything, so a check written as ``error > tol`` would pass it.
2. **Exact backends** (kvc's numpy runtime, OpenVINO CPU at f32, f32 KV): identical tokens and
   logits within ``F32_ATOL + F32_RTOL × max |reference logit|`` (``f32_bound``; its absolute
   part scaled down for logits below 1, ``logit_bound``).
3. **Reduced precision** (f16 or bf16 KV, the NPU plugin, OpenVINO CPU below f32): NRMSE ≤
   ``F16_NRMSE`` (0.05 when the KV cache is int8, or the graph selects with a TopK and the
   arithmetic is below f32, `nrmse_limit`) over the steps that share a context, and a token
   may differ only where rounding can explain it: the reference's margin between its token
   and the one chosen instead must be below twice the
   *noise* of this run, the largest logit error measured up to the divergence on every token
   but the two that swapped. Those two are left out at every step, not only at the divergent
   one: a flip forces an error of at least half the margin on one of them, and a fault in one
   token's logit (a wrong lm_head row or output channel) shows that error at every step, so
   counting them anywhere would let the flip explain itself (a logit 40 too high at the
   earlier steps excused a flip at margin 30 on the NPU's bounds). Where a
   run that does not depend on this one measured the arithmetic's own noise (the plugin's run
   of the source, `kvc.verify.peer_drift`), the noise is capped by it: a faulty run's error
   would otherwise excuse the flips it causes. Every allowed divergence is reported with its
   step, margin and noise.
   And every step's logits must still be the reference's: the RMS of the step's error (its
   mean removed: a constant shift changes no probability) at most ``STEP_ERROR`` (0.25) of the
   standard deviation of the reference step's logits (`step_error`). The aggregate NRMSE alone
   let wrong steps through: wrong steps after an exact prefill average to an NRMSE under
   int8's 0.05, and their error then excused a flipped token as noise (an int8 cache whose
   keys the generate models read back wrong passed the compile check on 8 of 24 fixtures).
   Rounding leaves a step at most 0.043 on the fixture zoo's compile probes (kvc's runtime
   with f16 KV 0.006, bf16 KV 0.008, int8 KV 0.039; CPU blobs at bf16 against it 0.043) and
   0.13 over 24 steps with int8 KV (xglm); that int8 bug showed 0.11 to 0.95, so the bound
   catches 6 of those 8 (falcon and gptj, at 0.17 and 0.19, pass it; the cache check of
   `kvc.verify.cache_rows` refuses them). Graphs that select
   (TopK) run below f32 or with an int8 cache are exempt (`step_limit`): there a flipped
   expert moves a whole step by design, and the aggregate bound stays their guard.
"""

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


def nonfinite_mismatch(ref, actual) -> str | None:
    """Where `actual` or `ref` holds a NaN/Inf that the other side does not hold identically
    (same value, same place), described for a person; None when there is no such place."""
    r, x = np.asarray(ref, np.float64), np.asarray(actual, np.float64)
    if r.shape != x.shape:
        raise ValueError(f"shapes differ: {r.shape} vs {x.shape}")
    same = (r == x) | (np.isnan(r) & np.isnan(x))
    bad = ~(np.isfinite(r) & np.isfinite(x)) & ~same
    if not bad.any():
        return None
    where = np.unravel_index(int(np.argmax(bad)), bad.shape)
    place = (f"step {where[0]}, token {where[-1]}" if len(where) >= 2 else
             f"index {where[0]}" if where else "the only value")
    return (f"{int(bad.sum())} non-finite logit(s), first at {place}: "
            f"reference {r[where]:.6g}, found {x[where]:.6g}")


def poisoned(logits) -> str | None:
    """Where a run's logits (per-step arrays) hold a NaN or +Inf, described; None if nowhere."""
    x = np.stack([np.asarray(step, np.float64).reshape(-1) for step in logits]) if len(logits) else np.zeros((0, 0))
    bad = np.isnan(x) | (x == np.inf)
    if not bad.any():
        return None
    step, token = np.unravel_index(int(np.argmax(bad)), bad.shape)
    return f"{int(bad.sum())} non-finite (NaN/+Inf) logit(s), first at step {step}, token {token} ({x[step, token]:.6g})"


def count_nonfinite(logits) -> int:
    """NaN and ±Inf values among a run's logits (a list of per-step arrays)."""
    return int(sum(np.count_nonzero(~np.isfinite(x)) for x in logits))


def reduced_arithmetic(backend: str, config: dict | None = None) -> bool:
    """Whether a run computes below f32: the NPU plugin (unless `config` runs it through NPUW on
    the CPU at f32, as kvc's NPU blobs run without an NPU), or an OpenVINO `config` whose
    inference precision is not f32 (CPU blobs compiled at the plugin's default: bf16 on hosts
    with AVX512_BF16 or AMX), or one that quantizes activations (`dynamic_quantization`)."""
    config = config or {}
    f32 = config.get("INFERENCE_PRECISION_HINT", "f32") == "f32"
    if backend == "npu":
        return not (f32 and config.get("NPUW_DEVICES") == "CPU")
    return not f32 or dynamic_quantization(config)


def dynamic_quantization(config: dict | None) -> bool:
    """Whether an OpenVINO CPU `config` quantizes activations to 8 bits where weights are
    stored as integers (DYNAMIC_QUANTIZATION_GROUP_SIZE above 0, the plugin's default of 32 on
    x86): its int8 and int4-per-channel MatMuls are then not f32 arithmetic, whatever the
    inference precision (kvc compile sets 0 where no weight is an integer, `export_config`)."""
    return str((config or {}).get("DYNAMIC_QUANTIZATION_GROUP_SIZE", "0")) != "0"


def int8_kv(kv_element_types) -> bool:
    """Whether the KV cache is stored as 8-bit integers (kv-io's int8 with its scales)."""
    return any(t in ("i8", "u8") for t in kv_element_types)


def reduced_precision(kv_element_types, backend: str, config: dict | None = None) -> bool:
    """Whether a run is judged as reduced precision (module docstring, rule 3): KV stored in
    anything but f32, or arithmetic below f32 (`reduced_arithmetic`)."""
    return reduced_arithmetic(backend, config) or any(t != "f32" for t in kv_element_types)


def step_error(ref, actual, skip=()) -> float:
    """How far one step's logits are from the reference's: the RMS of `actual - ref` with its
    mean removed (softmax ignores a constant shift), over the standard deviation of `ref`;
    finite positions only, the indices in `skip` left out. 0 for the same logits, about 1.4 for
    unrelated logits of the same spread."""
    r, x = np.asarray(ref, np.float64).reshape(-1), np.asarray(actual, np.float64).reshape(-1)
    keep = np.isfinite(r) & np.isfinite(x)
    keep[list(skip)] = False
    if keep.sum() < 2:
        return 0.0
    error = x[keep] - r[keep]
    return float(np.sqrt(np.mean((error - error.mean()) ** 2)) / max(float(r[keep].std()), 1e-12))


def _finite_pairs(r: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = np.isfinite(r) & np.isfinite(x)
    return r[keep], x[keep]


# REFERENCE.md §7: f32 paths compare logits at 1e-4 (optimum-intel's atol), plus 1e-5 of the
# logits' magnitude; f16 paths by NPUW's NRMSE bound and top-1.
F32_ATOL = 1e-4
F32_RTOL = 1e-5


def f32_bound(ref) -> float:
    """The largest max |actual - ref| an exact path may show: F32_ATOL + F32_RTOL × the largest
    finite |ref|. Two correct f32 engines sum in different orders, and that rounding grows with
    the magnitudes summed: xglm's logits reach 15, and OpenVINO CPU's AVX-512 kernels differ
    from kvc's numpy by 1.4e-4 over 24 steps (NRMSE 4e-7), where its AVX2 kernels stay under
    1e-4. The relative part is about 80 ULPs of the largest value (ULP(16) = 1.9e-6), a hundredth
    of the 1e-3 relative tolerance OpenVINO's own transformation tests use."""
    return F32_ATOL + F32_RTOL * _largest(ref)


def logit_bound(ref) -> float:
    """`f32_bound` for logits, its absolute part scaled down with logits whose largest finite
    |value| is below 1: F32_ATOL x min(1, that) + F32_RTOL x that. A model that scales its
    logits down (Cohere's logit_scale: the cohere fixtures' reach 0.2) computes them as precisely
    relative to their size, and the absolute 1e-4 was 1250x what cohere2's correct runs show
    (8e-8): the compile published its generate models with layer 1's o_proj 0.1% too large
    (5.6e-5; tests/mutation). Logits of 1 and more keep `f32_bound`."""
    largest = _largest(ref)
    return F32_ATOL * min(1.0, largest) + F32_RTOL * largest


def _largest(ref) -> float:
    r = np.abs(np.asarray(ref, np.float64))
    r = r[np.isfinite(r)]
    return float(r.max()) if r.size else 0.0


F16_NRMSE = 0.01
# int8 KV rounds each cached value to 1/254 of its row's range (f16: 2^-11 relative): on most
# fixtures the logits stay within NRMSE 2e-3, but a mixture-of-experts router that a small
# change turns to another expert moves whole tokens' outputs, as OpenVINO's own bf16 does
# (NPUW_LLM at bf16 on qwen3_moe: 0.0235). Measured on the fixture zoo at 24 steps: at most
# 0.026 (docs/kv-precision.md). The token rule is unchanged.
INT8_KV_NRMSE = 0.05
# A graph that selects (TopK: a mixture-of-experts router) turns a rounding difference into
# another choice, and a whole token's output moves with it: on gpt_oss (4 experts, top 2) CPU
# blobs computing at bf16 keep NRMSE 0.002 against kvc's f32 runtime on most prompts, and reach
# 0.093 at the one step where an expert flips (0.038 over the run), 0.019 where a weight nearly
# ties; at f32 the same blobs are within 4e-7. Such graphs get int8's bound when their
# arithmetic is below f32 (bf16 CPU blobs, the NPU): a blob that misplaces its rotary halves
# (the failure the blob check exists for) still shows 0.22. A f16 or bf16 KV cache alone moves
# the MoE fixtures by at most 6e-4, so runs in f32 arithmetic (kvc's numpy runtime, the check
# that catches the passes' bugs) keep F16_NRMSE: there an attention output 1.3x too large in
# one layer of gpt_oss shows 0.026 and fails.
SELECTING_NRMSE = INT8_KV_NRMSE
# The largest `step_error` a reduced-precision step may show (module docstring, rule 3).
STEP_ERROR = 0.25
# Runs in f32 arithmetic over a cache stored at f16 or bf16 (kvc's NPU blobs on NPUW's CPU
# backend, exact CPU blobs, `kvc verify --backend numpy`), which only the cache's rounding
# moves. Over the fixture zoo's compile probes at P 64 (scripts/drift.py --forms
# npu,cpu-f32-f16,cpu-f32-bf16, and --rounded for kvc's interpreter) they moved at most NRMSE
# 1.7e-4 and a step error of 0.0016 with an f16 cache, 1.4e-3 and 0.0094 with bf16; the
# bench model at P 1024 (bf16) 2e-4 and 0.0019. NPUW's NRMSE 0.01 and the step bound 0.25 were
# 6x to 150x that: a fault of a few percent passed. These are about 5x the worst. A graph that
# selects keeps F16_NRMSE and STEP_ERROR (a rounded cache may turn a router to another expert).
ROUNDED_CACHE_NRMSE = {"f16": 1e-3, "bf16": 5e-3}
ROUNDED_CACHE_STEP = {"f16": 0.01, "bf16": 0.05}


def same_quantization(kv_element_types, selects: bool, backend: str, config: dict | None) -> bool:
    """Whether runs on `backend` with `config` are judged against the IR run over the same int8
    cache (`kvc.verify.compiled.judge_same_quantization`) rather than the widened IR: f32
    arithmetic over an int8 cache, in a graph that does not select (a router a moved value
    turns to another expert moves a whole token: int8's fixed bounds stay its own)."""
    return int8_kv(kv_element_types) and not selects and not reduced_arithmetic(backend, config)


def rounded_cache_only(kv_element_types, backend: str, config: dict | None) -> bool:
    """Whether only a cache stored at f16 or bf16 moves a run: f32 arithmetic (kvc's NPU blobs on
    NPUW's CPU backend, exact CPU blobs) over a rounded cache, not int8."""
    return _rounded_cache_only(kv_element_types, False, backend, config) is not None


def _rounded_cache_only(kv_element_types, selects: bool, backend: str, config: dict | None) -> str | None:
    """The cache type whose rounding alone moves a run in f32 arithmetic (`ROUNDED_CACHE_NRMSE`;
    the coarser where there are two), else None."""
    if selects or reduced_arithmetic(backend, config) or int8_kv(kv_element_types):
        return None
    types = [t for t in ("bf16", "f16") if t in kv_element_types]
    return types[0] if types else None


def nrmse_limit(kv_element_types, selects: bool = False, backend: str = "numpy", config: dict | None = None) -> float:
    """The NRMSE a reduced-precision run may show: wider for an int8 KV cache, or when the graph
    `selects` (a TopK) and the run on `backend` with `config` computes below f32
    (`reduced_arithmetic`); narrower where only the cache's rounding moves it
    (`ROUNDED_CACHE_NRMSE`)."""
    if selects and reduced_arithmetic(backend, config):
        return SELECTING_NRMSE
    rounded = _rounded_cache_only(kv_element_types, selects, backend, config)
    if rounded is not None:
        return ROUNDED_CACHE_NRMSE[rounded]
    return INT8_KV_NRMSE if int8_kv(kv_element_types) else F16_NRMSE


def step_limit(kv_element_types=(), selects: bool = False, backend: str = "numpy",
               config: dict | None = None) -> float | None:
    """The `step_error` bound of a reduced-precision run: STEP_ERROR, narrower where only the
    cache's rounding moves it (`ROUNDED_CACHE_STEP`), or none for a graph that `selects` run
    below f32 (`reduced_arithmetic`) or with an int8 KV cache, where a flipped expert moves a
    whole step."""
    moves = reduced_arithmetic(backend, config) or int8_kv(kv_element_types)
    if selects and moves:
        return None
    rounded = _rounded_cache_only(kv_element_types, selects, backend, config)
    return STEP_ERROR if rounded is None else ROUNDED_CACHE_STEP[rounded]


@dataclass(frozen=True)
class Comparison:
    """Logit metrics over the steps both runs share up to the first divergent token (after
    it the two runs condition on different tokens, so their logits are not comparable).
    Metrics cover finite positions only; `nonfinite` says where the others are."""

    max_abs: float
    nrmse: float
    top1: float
    first_divergent_token: int | None
    steps: int
    margin_at_divergence: float | None = None  # reference: its token's logit minus the chosen one's
    noise: float | None = None  # largest logit error up to the divergence, but the swapped pair's (module docstring)
    nonfinite: str | None = None
    bound: float = F32_ATOL  # what an exact path's max_abs may reach here (logit_bound of the reference)
    step_error: float = 0.0  # the worst step's `step_error` (the divergent step without its two swapped tokens)
    step_error_at: int | None = None  # that step

    def to_dict(self) -> dict:
        return asdict(self)


def compare_generations(ref, actual) -> Comparison:
    """Compare two `Generation`s: per-step logits and the token streams."""
    div = first_divergence(ref.tokens, actual.tokens)
    steps = min(len(ref.logits), len(actual.logits), (div + 1) if div is not None else len(ref.logits))
    if not steps:
        return Comparison(0.0, 0.0, 1.0, div, 0)
    r = np.stack(ref.logits[:steps]).astype(np.float64)
    a = np.stack(actual.logits[:steps]).astype(np.float64)
    bad = nonfinite_mismatch(r, a)
    fr, fa = _finite_pairs(r, a)
    m = noise = None
    if div is not None and div < steps and div < len(actual.tokens):
        mine, theirs = ref.tokens[div], actual.tokens[div]
        m = float(r[div, mine] - r[div, theirs])
        error = np.abs(r - a)[: div + 1]
        error[:, [mine, theirs]] = 0.0
        noise = float(np.max(error[np.isfinite(error)], initial=0.0))
    errors = [step_error(r[i], a[i], (ref.tokens[div], actual.tokens[div]) if i == div and m is not None else ())
              for i in range(steps)]
    worst = int(np.argmax(errors))
    return Comparison(max_abs(fr, fa), nrmse(fr, fa), top1_agreement(r, a), div, steps, m, noise, bad, logit_bound(fr),
                      errors[worst], worst)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    comparison: Comparison
    reason: str

    def to_dict(self) -> dict:
        return {"ok": self.ok, "reason": self.reason, **self.comparison.to_dict()}


def judge(ref, actual, *, reduced: bool = False, limit: float = F16_NRMSE,
          step_bound: float | None = STEP_ERROR, noise_cap: float | None = None) -> Verdict:
    """Whether `actual` reproduces `ref` under the policy in the module docstring; `reduced`
    for a reduced-precision path (f16 KV, the NPU plugin, CPU below f32), else exact; `limit`
    its NRMSE bound (`nrmse_limit`), `step_bound` its bound on every step's error (`step_limit`);
    `noise_cap` the most noise a near-tie may take from this run, measured by a run that does
    not depend on it (`kvc.verify.peer_drift`): a faulty run's own error would excuse its flips."""
    c = compare_generations(ref, actual)
    div = c.first_divergent_token
    for side, run in (("found", actual), ("reference", ref)):
        bad = poisoned(run.logits[:max(c.steps, 1)])
        if bad is not None:
            return Verdict(False, c, f"{bad} in the {side} run" + (
                "; the source model itself computes them, so there is nothing to verify against"
                if side == "reference" else ""))
    if c.nonfinite is not None:
        return Verdict(False, c, c.nonfinite)
    if div is not None and c.margin_at_divergence is None:
        return Verdict(False, c, f"{len(actual.tokens)} tokens generated, {len(ref.tokens)} expected")
    if not reduced:
        if div is not None:
            return Verdict(False, c, f"token {div} differs: {ref.tokens[div]} expected, {actual.tokens[div]} found "
                                     f"(reference margin {c.margin_at_divergence:.4g})")
        if c.max_abs > c.bound:
            return Verdict(False, c, f"logits differ by {c.max_abs:.3g} > {c.bound:.3g}")
        return Verdict(True, c, f"identical tokens, logits within {c.bound:.3g}")
    if step_bound is not None and c.step_error > step_bound:
        return Verdict(False, c, f"step {c.step_error_at}'s logits are not the reference's: their error is "
                                 f"{c.step_error:.3g} of the logits' spread (at most {step_bound:.3g})")
    if c.nrmse > limit:
        return Verdict(False, c, f"NRMSE {c.nrmse:.3g} > {limit}")
    within = f"NRMSE {c.nrmse:.3g} (at most {limit:.3g})" + (
        "" if step_bound is None else f", worst step {c.step_error:.3g} (at most {step_bound:.3g})")
    if div is None:
        return Verdict(True, c, f"identical tokens, {within}")
    what = (f"token {div} differs ({ref.tokens[div]} expected, {actual.tokens[div]} found) at reference margin "
            f"{c.margin_at_divergence:.3g}")
    noise = c.noise if noise_cap is None else min(c.noise, noise_cap)
    said = f"{noise:.3g}" + (f" (this run's own {c.noise:.3g}, capped)" if noise < c.noise else "")
    if c.margin_at_divergence >= 2 * noise:
        return Verdict(False, c, f"{what}, not below twice the logit noise {said} before it")
    return Verdict(True, c, f"{what}, below twice the logit noise {said}: a near-tie; {within}")
