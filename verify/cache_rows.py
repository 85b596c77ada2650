"""The KV cache itself, checked: the rows a static pipeline holds after a run against the
source model's own cache after the same tokens.

The logits alone can miss a wrong cache. A cache whose keys the generate models read back
with other scales than the prefill stored (an int8 bug kvc had) moved each step's logits by
0.17-0.19 of their spread on two fixtures while the top tokens held, inside what the logit
rules must allow int8 (0.13 over 24 steps). The rows themselves were off by a factor per
channel. This check compares every row the source model's cache holds for the tokens both
runs fed (the prompt, and each generated token up to the first that differs) with the row the
static pipeline holds there, read as the generate models read it: f16 and bf16 rows widened
to f32, int8 rows through a generate model's own dequantization (kv-io's
``<input>/dequantize``, evaluated by kvc's interpreter), so a prefill that stores rows one way
and generate models that read them another cannot both look right.

Each row is a position of one KV tensor (every head at once); its error is the RMS of the
difference over the RMS of the source's row (`row_error`), bounded by what storing the row in
the cache's element type may do (`ROW_ERROR`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvc.passes.lift_state import lifted_name
from kvc.runtime.generate import PAST_INPUT

# The largest `row_error` a cache row may show, by the element type the cache stores. A row
# of the prompt computed over no rounded rows differs by one rounding to that type (at most
# 2^-11 of each element in f16, 2^-8 in bf16, half a step of 1/127 of its head's largest
# channel-scaled magnitude in int8); a row computed by attending over rounded rows (every
# generated token's, a later chunk's) carries their error through the layers too. Measured on
# the fixture zoo (every fixture, chunked and unchunked prefill, compile's probes and a 24-step
# run; docs/verification.md): at most 2.8e-6 (f32, two engines summing in different orders),
# 0.0021 (f16), 0.012 (bf16), 0.043 (int8); a prefill that stored int8 keys with other scales
# than the generate models read them with: 1.5 to 4. Bounds about three times the zoo's worst.
ROW_ERROR = {"f32": 1e-4, "f16": 0.006, "bf16": 0.04, "i8": 0.15}
# The blob check's bound on the rows of blobs computing below f32 (the CPU at bf16) against the
# IR's rows on kvc's interpreter, whatever the cache type (the arithmetic dominates): measured
# on the zoo's compile probes (every fixture; f32, f16 and bf16 caches, chunked and unchunked)
# at most 0.0082, and 0.021 on the 16-layer bench model (errors grow with depth); blobs
# computing at f32 (NPUW's CPU backend) keep ROW_ERROR, measured at most 2e-4 with an f16
# cache. An int8 cache is not compared on blobs (`stored_rows`).
BLOB_ROW_ERROR = {"f32": 0.1, "f16": 0.1, "bf16": 0.1, "i8": 0.1}
# A cache widened to f32 (`kvc.verify.compiled.widens`): every cache type held to f32's bound.
WIDENED_ROW_ERROR = dict.fromkeys(ROW_ERROR, ROW_ERROR["f32"])


@dataclass(frozen=True)
class CacheCheck:
    """The worst row of a run's cache against the source's."""

    ok: bool
    rows: int  # positions compared
    error: float  # the worst `row_error`
    tensor: str | None = None  # where it was
    position: int | None = None
    bound: float = 0.0
    against: str = "the source model's"  # whose rows these were compared with

    def reason(self) -> str:
        if self.ok:
            return f"KV cache rows within {self.bound:.3g} of {self.against} ({self.rows} positions)"
        return (f"KV cache row {self.position} of {self.tensor} is not {self.against}: its error is "
                f"{self.error:.3g} of the row's RMS (at most {self.bound:.3g} for this cache type)")

    def to_dict(self) -> dict:
        return {"cache_ok": self.ok, "cache_rows": self.rows, "cache_error": self.error,
                "cache_error_at": None if self.tensor is None else f"{self.tensor}[{self.position}]"}


def source_rows(cache: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The source model's cache after a run (`greedy(keep_cache=True)`), by the static models'
    input names: a stateful model's variable ids named as lift-state names their inputs, a
    stateless model's past inputs as they are."""
    return {name if PAST_INPUT.match(name) else lifted_name(name).input_name: np.asarray(v, np.float32)
            for name, v in cache.items()}


def source_run(session, prompt, new_tokens: int, origin: int = 0, filled: bool = False, media=None):
    """Greedy decoding on the source model (`greedy`, from position `origin`, over a far past
    with `filled`, with the prompt's `media`), its cache kept by the static models' input
    names (`source_rows`): the reference of the cache check."""
    from kvc.runtime.generate import greedy

    gen = greedy(session, prompt, new_tokens, keep_cache=True, origin=origin, filled=filled, media=media)
    gen.cache = source_rows(gen.cache)
    return gen


def held_rows(pipe, rows: int, origin: int = 0) -> dict[str, np.ndarray]:
    """Positions `[origin, rows)` of every KV tensor a static pipeline on kvc's interpreter
    holds (a run from `origin`, `StaticGeneration.origin`), as f32 read the way its generate
    models read them (module docstring): copies, which the next run does not overwrite."""
    stored = stored_rows(pipe, rows, origin)
    if stored is not None:
        return stored
    return _dequantized(pipe, [spec.input for spec in pipe.kv if not spec.kind.endswith("_scale")], rows, origin)


def stored_rows(pipe, rows: int, origin: int = 0) -> dict[str, np.ndarray] | None:
    """Positions `[origin, rows)` of every KV tensor any static pipeline holds, as f32 copies:
    the rows as read for an f32, f16 or bf16 cache; None for an int8 cache (its rows are read
    through the generate models' dequantization, which only kvc's interpreter exposes)."""
    if any(spec.kind.endswith("_scale") for spec in pipe.kv):
        return None
    return {spec.input: np.array(pipe.past_view(spec, rows)[pipe._rows(spec, origin, rows)], np.float32)
            for spec in pipe.kv}


def _dequantized(pipe, names: list[str], rows: int, origin: int = 0) -> dict[str, np.ndarray]:
    """int8 rows as the largest generate model dequantizes them: one step of it on kvc's
    interpreter, capturing each input's `dequantize_name` value (what feeds its attention)."""
    from kvc.errors import VerificationError
    from kvc.ir.naming import name_model
    from kvc.passes.kv_io import dequantize_name
    from kvc.runtime.static_pipeline import StaticPipeline

    size = max(pipe.generate_sessions)
    session = pipe.generate_sessions[size]
    model = session.interpreter.model
    naming = name_model(model)
    nodes = {op.get_friendly_name(): op for op in model.get_ops()}
    wanted = {}
    for name in names:
        node = nodes.get(dequantize_name(name))
        if node is None:
            raise VerificationError(f"generate-{size} has no {dequantize_name(name)} node: cannot read its int8 "
                                    f"cache back")
        wanted[naming.value(node.output(0))] = name
    G = pipe.lengths.tokens
    mask = np.zeros((1, size), np.int64)
    mask[0, origin:rows] = 1
    mask[0, size - G:] = 1
    feed = StaticPipeline.step_feed(session, np.zeros((1, G), np.int64), mask, np.full((1, G), rows, np.int64))
    _, captured = session.capture(feed, set(wanted))
    spec_of = {spec.input: spec for spec in pipe.kv}
    out = {}
    for value, name in wanted.items():
        index = [slice(None)] * captured[value].ndim
        index[spec_of[name].seq_axis] = slice(origin, rows)
        out[name] = np.asarray(captured[value][tuple(index)], np.float32)
    return out


def row_error(ref: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Per position (axis 0): RMS of `actual - ref` over the RMS of `ref` (every other axis at
    once), a row's RMS taken as at least ROW_FLOOR of the whole tensor's (a row of near-zero
    values, an attention sink's, carries its layers' absolute error, not a relative one);
    non-finite values count as infinitely wrong."""
    ref, actual = ref.astype(np.float64), actual.astype(np.float64)
    ref, actual = ref.reshape(ref.shape[0], -1), actual.reshape(actual.shape[0], -1)
    diff = np.sqrt(np.mean((actual - ref) ** 2, axis=1))
    scale = np.sqrt(np.mean(ref ** 2, axis=1))
    floor = ROW_FLOOR * float(np.sqrt(np.mean(ref ** 2))) if ref.size else 0.0
    error = diff / np.maximum(np.maximum(scale, floor), 1e-30)
    return np.where(np.isfinite(error), error, np.inf)


ROW_FLOOR = 0.05


def compare_cache(ref: dict[str, np.ndarray], held: dict[str, np.ndarray], kv, rows: int, *,
                  every_layer: bool = True, bounds: dict[str, float] | None = None,
                  against: str = "the source model's", static_ref: bool = False) -> CacheCheck:
    """Every position `[0, rows)` of each KV tensor of `held` (`held_rows`) against the
    source's (`source_rows`), each tensor bounded by its cache type's `ROW_ERROR` (or
    `bounds`); the result names the row furthest past (or nearest to) its bound, and whose rows
    they were compared with (`against`, for the reason). Without `every_layer`, the first
    layer's tensors only: their rows depend on nothing but their token and position, where a
    later layer's follow every choice before it (a mixture-of-experts router that rounding
    turns to another expert moves the whole row, by design)."""
    from kvc.errors import VerificationError

    first = min(spec.layer for spec in kv)
    # the reference's sequence axis: a static cache's as `held`'s (`static_ref`: another static
    # pipeline's rows), the source's as its layer's key's (a value stored transposed is not)
    keys = {} if static_ref else {spec.layer: spec.seq_axis for spec in kv if spec.kind == "key"}
    worst, ratio = CacheCheck(True, rows, 0.0, against=against), -1.0
    for spec in kv:
        if spec.kind.endswith("_scale") or not every_layer and spec.layer != first:
            continue
        if spec.input not in ref:
            raise VerificationError(f"the source model's cache has no {spec.input} (it has "
                                    f"{', '.join(sorted(ref)) or 'none'})")
        a, r = _aligned(spec, held[spec.input], ref[spec.input], rows, keys.get(spec.layer, spec.seq_axis))
        errors = row_error(r, a)
        bound = (bounds or ROW_ERROR)[spec.element_type]
        at = int(np.argmax(errors)) if errors.size else 0
        if errors.size and errors[at] / bound > ratio:
            ratio = errors[at] / bound
            worst = CacheCheck(bool(ratio <= 1.0), rows, float(errors[at]), spec.input, at, bound, against)
    return worst


def _aligned(spec, held: np.ndarray, ref: np.ndarray, rows: int, source_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `rows` positions of `held` and of `ref`, each with its positions on axis 0: the
    source's sequence axis is its layer's key's (`source_axis`; the spec's own unless the cache
    stores the tensor transposed, values with the sequence last), else the axis the shapes
    then line up on. By shapes first, a 2-row run of llama with its 2 KV heads compared heads
    as rows, and a 16-row one its head dimension of 16: a correct --transpose-v compile, and
    `kvc verify` of one, were refused."""
    from kvc.errors import VerificationError

    for axis in (source_axis, spec.seq_axis, *range(ref.ndim)):
        if held.ndim != ref.ndim or ref.shape[axis] < rows:
            continue
        moved = np.moveaxis(held, spec.seq_axis, 0)[:rows]
        source = np.moveaxis(ref, axis, 0)[:rows]
        if moved.shape == source.shape and len(moved) == rows:
            return moved, source
    raise VerificationError(f"{spec.input}: the static cache's rows {held.shape} (sequence on axis {spec.seq_axis}) "
                            f"do not line up with the source model's cache {ref.shape}")
