"""Moving KV rows to other positions: which position schemes allow it, and the re-rotation.

Chunk-level reuse (`kvc.cache.chunks`) puts rows computed at positions `[p0, p0 + B)` at
`[p1, p1 + B)`. What that needs depends on how the model encodes position in its keys:

* rotary (RoPE): a key at position p is ``R(p) k`` with R a rotation of channel pairs by
  ``p * inv_freq``; rotations compose, so ``R(p1 - p0)`` applied to the stored key gives the
  key at p1. Pairs are halves (rotate-half, Llama) or neighbours (interleaved, GPT-J,
  Cohere), over the whole head or its first `rotary_dim` channels (partial rotary).
  ``inv_freq = theta ** (-2j / rotary_dim)`` (`rope_type` "default"), divided by `factor`
  ("linear"), YaRN's blend ("yarn") or Llama 3.1's by wavelength ("llama3"); other rope
  types are refused.
* no position in the key (layers without positional encoding; ALiBi-style biases, which
  depend only on distances): the rows move unchanged.
* position mixed into the hidden states (learned or sinusoidal absolute positions): no
  transform of the rows gives the moved ones; refused.

kvc does not trust its reading of config.json: `calibrate` runs the model's own prefill on
one chunk of seeded tokens at positions 0.. and again shifted by the largest move the
pipeline can make. In a model whose keys carry position only by rotation, the shift changes
no attention score, so every value row must come out equal and every key row equal to the
first run's key rotated by the shift. Each layer takes the first of no-move or a rotary
reading of the config that explains its keys (relative RMS error <= MOVE_TOLERANCE); a value
that moved, or a key no candidate explains, refuses chunk reuse naming the layer and the
error. A model without a `position_ids` input (positions derived from the mask, ALiBi)
cannot be shifted this way and is refused, as is int8 KV (rotating needs dequantized keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvc import jsontext
from kvc.errors import UsageError
from kvc.runtime.embeddings import language_config
from kvc.runtime.ops.registry import to_dtype

MOVE_TOLERANCE = 1e-2  # RMS error of a moved row, relative to the RMS of the row computed there (f16 KV: ~1e-3)


class ChunkReuseRefused(UsageError):
    """The model's keys cannot be moved to other positions (or kvc cannot check that they can)."""


@dataclass(frozen=True)
class Rotary:
    """A rotary reading: pairs rotated by ``position * inv_freq`` over the first `dim` channels."""

    inv_freq: tuple[float, ...]
    dim: int
    interleaved: bool

    def describe(self) -> str:
        return f"rotary over {self.dim} channels ({'interleaved' if self.interleaved else 'rotate-half'} pairs)"

    def rotate(self, keys: np.ndarray, delta: int) -> np.ndarray:
        """`keys` [..., S, D] rotated by `delta` positions (computed in float64, cast back)."""
        x = keys.astype(np.float64)
        angle = delta * np.asarray(self.inv_freq, np.float64)
        cos, sin = np.cos(angle), np.sin(angle)
        half = self.dim // 2
        out = x.copy()
        if self.interleaved:
            a, b = x[..., 0:self.dim:2], x[..., 1:self.dim:2]
            out[..., 0:self.dim:2] = a * cos - b * sin
            out[..., 1:self.dim:2] = b * cos + a * sin
        else:
            a, b = x[..., :half], x[..., half:self.dim]
            out[..., :half] = a * cos - b * sin
            out[..., half:self.dim] = b * cos + a * sin
        return out.astype(keys.dtype)


def _rope_parameters(config: dict) -> dict:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in params and key in config:
            params[key] = config[key]
    return params


def longrope_switch(config: dict) -> int | None:
    """LongRoPE's original positions T where a (language model's) config states rope type
    longrope: optimum's export takes a call's rotary factors long when its longest position
    reaches T, short below (kvc.export.compile.model_longrope); None otherwise."""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(params, dict) or "longrope" not in (params.get("rope_type"), params.get("type")):
        return None
    switch = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    return switch if isinstance(switch, int) and not isinstance(switch, bool) and switch > 0 else None


def inverse_frequencies(config: dict, dim: int) -> tuple[float, ...]:
    """The rotary frequencies a Hugging Face config gives `dim` rotated channels."""
    params = _rope_parameters(config)
    theta = float(params.get("rope_theta", config.get("rotary_emb_base", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    base = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if kind == "default":
        return tuple(base)
    if kind == "linear":
        return tuple(base / float(params["factor"]))
    if kind == "yarn":
        return tuple(_yarn(params, theta, dim, base))
    if kind == "llama3":
        return tuple(_llama3(params, base))
    raise ChunkReuseRefused(f"rope type {kind!r} is not one kvc can move keys for (default, linear, yarn, llama3)")


def _llama3(params: dict, base: np.ndarray) -> np.ndarray:
    """Llama 3.1's frequencies (transformers' _compute_llama3_parameters): a wavelength below
    original / high_freq_factor keeps its frequency, one above original / low_freq_factor is
    divided by `factor`, and those between blend the two by where they fall."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / base
    scaled = np.where(wavelen > original / low, base / factor, base)
    smooth = (original / wavelen - low) / (high - low)
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def _yarn(params: dict, theta: float, dim: int, base: np.ndarray) -> np.ndarray:
    """YaRN's frequencies (transformers' _compute_yarn_parameters)."""
    factor = float(params["factor"])
    original = float(params.get("original_max_position_embeddings"))
    fast, slow = float(params.get("beta_fast", 32.0)), float(params.get("beta_slow", 1.0))

    def correction(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return base / factor * (1 - extrapolation) + base * extrapolation


def by_layer_type(config: dict) -> list[dict]:
    """`config` once per rotary its layers use: transformers' `rope_parameters` keyed by layer
    type (Gemma 3: "sliding_attention" at theta 1e4, "full_attention" at 1e6) gives one config
    per type; any other config is itself."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return [{**config, "rope_parameters": params[kind]} for kind in sorted(params)]
    return [config]


def candidates(config: dict, head_dim: int) -> list[Rotary]:
    """Rotary readings of `config` to try: each layer type's (`by_layer_type`), over the
    partial dimension it names (or the whole head), rotate-half and interleaved pairs."""
    found = []
    for layer_config in by_layer_type(config):
        params = _rope_parameters(layer_config)
        dims = []
        if layer_config.get("rotary_dim"):
            dims.append(int(layer_config["rotary_dim"]))
        if params.get("partial_rotary_factor"):
            dims.append(int(head_dim * float(params["partial_rotary_factor"])))
        dims.append(head_dim)
        for dim in dict.fromkeys(d for d in dims if 0 < d <= head_dim and d % 2 == 0):
            freqs = inverse_frequencies(layer_config, dim)
            found += [Rotary(freqs, dim, interleaved) for interleaved in (False, True)]
    return found


def relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    """RMS of `got - want` over the RMS of `want` (not compare.nrmse, which divides by the range)."""
    want = want.astype(np.float64)
    scale = float(np.sqrt(np.mean(want ** 2))) or 1.0
    return float(np.sqrt(np.mean((got.astype(np.float64) - want) ** 2))) / scale


@dataclass(frozen=True)
class Mover:
    """How to move each key tensor's rows (by input name); values and scales move unchanged."""

    rotations: dict  # key input name -> Rotary | None (None: the rows move unchanged)
    checked_shift: int
    errors: dict  # tensor input name -> relative RMS error of the calibration move

    def move(self, rows: dict[str, np.ndarray], delta: int) -> dict[str, np.ndarray]:
        if delta == 0:
            return rows
        out = dict(rows)
        for name, rotary in self.rotations.items():
            if rotary is not None:
                out[name] = rotary.rotate(rows[name], delta)
        return out

    def describe(self) -> list[str]:
        return [f"{name}: {'unchanged' if r is None else r.describe()} "
                f"(calibration relative RMS error {self.errors[name]:.2g})"
                for name, r in self.rotations.items()]


def _past_shape(spec, rows: int) -> tuple[int, ...]:
    shape = list(spec.shape)
    shape[spec.seq_axis] = rows
    return tuple(shape)


def model_config(directory) -> dict | None:
    """The Hugging Face config.json a compiled directory carries, its language model's
    (`language_config`; None when absent)."""
    import json
    from pathlib import Path

    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        config = jsontext.loads(jsontext.read_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path}: a config is a JSON object, found {type(config).__name__}")
    return language_config(config)


def calibrate(pipeline, config: dict | None, seed: int = 0, exact=None) -> Mover:
    """Decide, by running the prefill, how each layer's rows move (module docstring). `exact`:
    a session of the same prefill model on an exact engine (kvc's numpy runtime) to run the
    check on instead of the pipeline's own, whose reduced-precision arithmetic (bf16 CPU
    blobs) moves deep layers' rows by more than the tolerance."""
    L = pipeline.lengths
    if not L.chunk:
        raise ChunkReuseRefused("chunk reuse needs a chunked prefill (compile with --prefill-chunk-size)")
    if not pipeline.prefill.has_input("position_ids"):
        raise ChunkReuseRefused("this model has no position_ids input (its positions come from the mask: ALiBi, or "
                                "GPT-NeoX-Japanese's rotary positions): "
                                "kvc cannot shift a chunk to check that its rows move, so chunk reuse is refused")
    if any(s.kind.endswith("_scale") for s in pipeline.kv):
        raise ChunkReuseRefused("chunk reuse with int8 KV is not supported (moving keys needs them dequantized)")
    if config is not None and longrope_switch(config) is not None:
        raise ChunkReuseRefused("this model's rotary is LongRoPE, whose factors a call takes by its longest position "
                                "(long from original_max_position_embeddings on): a chunk's rows depend on the call "
                                "that computed them, not on their positions alone, so chunk reuse is refused")
    C, P = L.chunk, L.prompt
    shift = P - C  # the largest move: a chunk computed at 0 reused at the end of the prompt, or back
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, pipeline.vocab or 2, C).reshape(1, C)
    mask = np.zeros((1, P), np.int64)
    mask[0, P - C:] = 1
    session = exact or pipeline.prefill
    pasts = {} if exact is None else {s.input: np.zeros(_past_shape(s, P - C), to_dtype(s.element_type))
                                      for s in pipeline.kv}
    runs = []
    for offset in (0, shift):
        pos = np.arange(offset, offset + C, dtype=np.int64).reshape(1, C)
        out = session.infer({**pipeline.step_feed(session, ids, mask, pos), **pasts})
        runs.append({s.input: np.array(out[s.output]) for s in pipeline.kv})
    first, shifted = runs
    rotations, errors = {}, {}
    for spec in sorted(pipeline.kv, key=lambda s: s.kind == "key"):  # values first: they say "absolute"
        a, b = first[spec.input], shifted[spec.input]
        if spec.kind != "key":
            errors[spec.input] = relative_rms(a, b)
            if errors[spec.input] > MOVE_TOLERANCE:
                raise ChunkReuseRefused(
                    f"layer {spec.layer}'s {spec.kind}s change when the whole chunk moves by {shift} positions "
                    f"(relative RMS error {errors[spec.input]:.2g}): the model mixes absolute positions into its "
                    f"hidden states, so rows computed at one position cannot be used at another")
            continue
        if spec.seq_axis != len(spec.shape) - 2:
            raise ChunkReuseRefused(f"{spec.input}: keys laid out with the sequence on axis {spec.seq_axis} "
                                    f"of {list(spec.shape)} cannot be rotated (expected [..., S, D])")
        try:
            options = [None, *candidates(config, spec.shape[-1])] if config is not None else [None]
        except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
            raise ChunkReuseRefused(f"the model's config.json has rotary parameters kvc cannot read "
                                    f"({type(exc).__name__}: {exc})") from None
        tried = []
        for rotary in options:
            moved = a if rotary is None else rotary.rotate(a, shift)
            err = relative_rms(moved, b)
            tried.append((err, rotary))
            if err <= MOVE_TOLERANCE:
                rotations[spec.input], errors[spec.input] = rotary, err
                break
        else:
            best = min(tried, key=lambda t: t[0])
            what = "unchanged" if best[1] is None else best[1].describe()
            raise ChunkReuseRefused(
                f"layer {spec.layer}'s keys moved by {shift} positions match no rotation kvc reads from the "
                f"model's config.json (closest: {what}, relative RMS error {best[0]:.2g} > {MOVE_TOLERANCE})"
                + ("" if config is not None else "; the compiled directory has no config.json"))
    return Mover({s.input: rotations[s.input] for s in pipeline.kv if s.input in rotations}, shift, errors)
