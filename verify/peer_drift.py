"""The bounds of runs computing below f32, set by the plugin's own drift on the same probe.

The blob check judges blobs computing at bf16 (CPU blobs at the plugin's default on a bf16
host) against the IR's exact run on kvc's interpreter. Fixed bounds cannot judge them well:
bf16 drift varies tenfold between models and prompts. OpenVINO's own stateful bloom fixture,
compiled by the CPU plugin at bf16, holds a key row 0.19 of its RMS away from its f32 run on a
521-token prompt, the llama fixture's 0.017; and the fixed bounds wide enough for the first
(NRMSE 0.01, a step error of 0.25) published a llama generate blob whose logits carried a bias
at 6x the arithmetic's drift (NRMSE 0.0078 against 0.0013), with a token it flipped excused as
a near-tie by that same wrong run's noise.

So the check measures that drift on every probe: the *peer* is the source model compiled by
the same plugin as the blobs were (their import configuration: the inference precision, the
dynamic quantization) with the KV cache stored in kvc's cache type, run on the same probe and
compared with the IR's exact run (which the compile check proved equal to the source's at f32)
as the blob run is. The blob run must then be within PEER_FACTOR of the peer on every measure
the arithmetic's precision moves (`Drift`), above a floor, never past a ceiling:

* the logits' NRMSE: at most PEER_FACTOR x the peer's, at least NRMSE_FLOOR, at most
  NRMSE_CEILING (the bound an int8 cache gets);
* every step's error (`step_error`): at most PEER_FACTOR x the peer's worst step, at least
  STEP_FLOOR, at most STEP_ERROR (the fixed bound);
* the cache rows' worst error (`compare_cache`): at most PEER_FACTOR x the peer's worst, at
  least ROW_FLOOR, at most ROW_CEILING (the faults the row check exists for measured 1.5 to 4);
* a token that differs: a near-tie only by a noise of at most PEER_FACTOR x the peer's logit
  noise up to there (`logit_noise`): a faulty run's own error would excuse the flips it causes
  (unless the peer chose the same token there).

Over the fixture zoo's 32 models at P 64 (128 probes, `scripts/drift.py --forms cpu`), correct
bf16 blobs were at most 1.40x the peer's NRMSE, 1.49x its step error, 1.28x its row error and
1.58x its logit noise; `kvc verify`'s runs of bloom at P 1024 2.04x its NRMSE and 2.3x its step
error on a 512-token prompt, hence a factor of 3. A graph that selects (a TopK router) keeps
the fixed bounds and is only ever widened by the peer (a blob's flipped expert moves it where
the peer's need not), and the peer never judges exact blobs (an f32 blob is judged exactly)
nor runs without the IR's runs (--no-verify). `kvc verify` judges its OpenVINO CPU runs below
f32 against the source at f32 the same way, on the logits (those runs keep no cache rows). A
peer that cannot be compiled or run leaves the fixed bounds' verdict, saying so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kvc.runtime.compare import INT8_KV_NRMSE, STEP_ERROR

PEER_FACTOR = 3.0
ROW_CEILING = 0.5
NRMSE_CEILING = INT8_KV_NRMSE
# The NRMSE bound of a graph that selects, where the peer drifts far itself (its own routers
# flipping experts): 3x the peer's, up to this. Capped at NRMSE_CEILING, correct blobs were
# refused where the plugin's own run drifted most: phimoe's 64-token prompt at 0.069 (the peer
# 0.035), granitemoe_int4_asym_cw's 32-token one at 0.118 (the peer 0.117). What keeps a fault
# out is `few_routers_flipped`: a probe past 3x the peer's bound is the exception.
SELECTING_NRMSE_CEILING = 0.15
# How far past the peer's NRMSE the probe a router's flip excuses may be (`few_routers_flipped`):
# correct blobs of the zoo's mixtures of experts were at most 4.4x (phimoe's 7-token probe, at
# the defaults and at P 64), faults confined to one probe 8.6x (qwen2_moe, the values of a
# generate blob's last slots read as zeros) to 20x.
EXCUSE_FACTOR = 6.0
# The least a bound may be, whatever the peer measured: about half the least drift of any probe
# over the zoo (NRMSE 0.00068, step 0.0056, rows 0.0032), so a probe where bf16 happens to
# round little is not held to nothing.
NRMSE_FLOOR = 3e-4
STEP_FLOOR = 3e-3
ROW_FLOOR = 1.5e-3
# The plugin's KV cache precision for each cache element type kvc stores.
_KV_CACHE_PRECISION = {"f32": "f32", "f16": "f16", "bf16": "bf16", "i8": "u8", "u8": "u8"}
_UNBOUNDED = dict.fromkeys(_KV_CACHE_PRECISION, 1e30)  # finite: compare_cache ranks rows by error / bound
# The import-configuration keys the peer takes: how the CPU blobs compute (`import_config`
# records both). Every other key stays out, whatever the manifest says: a manifest or a blob
# cache record that added KEY_CACHE_PRECISION u4 gave the peer a 4-bit cache, whose drift
# then excused a blob 30% off (its CPU import ignores the key).
_ARITHMETIC = ("INFERENCE_PRECISION_HINT", "DYNAMIC_QUANTIZATION_GROUP_SIZE")


def _bound(measured: float, floor: float, ceiling: float) -> float:
    return min(ceiling, max(floor, PEER_FACTOR * measured))


@dataclass(frozen=True)
class Drift:
    """How far the peer's run is from the IR's exact run on one probe, and the bounds that
    makes (module docstring)."""

    nrmse: float
    row_error: float | None  # None: the caches were not compared
    precision: str
    step_error: float = 0.0  # the worst step's
    noise: float | None = None  # the largest logit error up to the judged run's divergence (`logit_noise`)
    same_choice: bool = False  # the peer chose the judged run's token at that divergence

    def limit(self, fixed: float, selects: bool = False) -> float:
        """The NRMSE bound; for a graph that `selects`, the `fixed` one, only ever widened (up
        to SELECTING_NRMSE_CEILING)."""
        if selects:
            return min(SELECTING_NRMSE_CEILING, max(fixed, PEER_FACTOR * self.nrmse))
        return _bound(self.nrmse, NRMSE_FLOOR, NRMSE_CEILING)

    def step_bound(self, fixed: float | None) -> float | None:
        """The bound on every step's error; None where the `fixed` policy has none (a graph that
        selects below f32)."""
        return None if fixed is None else _bound(self.step_error, STEP_FLOOR, STEP_ERROR)

    def row_bounds(self, fixed: dict[str, float], selects: bool = False) -> dict[str, float]:
        """The bound on the cache rows' error, per cache type (the `fixed` ones where the caches
        were not compared; for a graph that `selects`, only ever widened)."""
        if self.row_error is None:
            return fixed
        if selects:
            return {t: min(ROW_CEILING, max(b, PEER_FACTOR * self.row_error)) for t, b in fixed.items()}
        return dict.fromkeys(fixed, _bound(self.row_error, ROW_FLOOR, ROW_CEILING))

    def noise_cap(self) -> float | None:
        """The most logit noise a near-tie of the judged run may claim: PEER_FACTOR x the peer's
        (None: no cap, where there is no divergence or the peer made the same choice)."""
        if self.noise is None or self.same_choice:
            return None
        return PEER_FACTOR * self.noise

    def describe(self) -> str:
        rows = "" if self.row_error is None else f", cache row error {self.row_error:.3g}"
        noise = "" if self.noise is None else f", logit noise {self.noise:.3g}"
        same = ", and chooses the same token where this run differs" if self.same_choice else ""
        return (f"OpenVINO CPU's own {self.precision} run of the source model drifts NRMSE {self.nrmse:.3g}, "
                f"step error {self.step_error:.3g}{rows}{noise}{same}")

    def to_dict(self) -> dict:
        out = {"peer_nrmse": self.nrmse, "peer_step_error": self.step_error, "peer_cache_error": self.row_error,
               "peer_precision": self.precision}
        if self.noise is not None:
            out["peer_noise"] = self.noise
        return out


def logit_noise(exact, peer, upto: int) -> tuple[float, int | None]:
    """The largest logit error of `peer` against `exact` over steps 0 to `upto` (a judged run's
    first divergent token), stopping at the peer's own first divergence, where the two tokens it
    swapped are left out (as `compare_generations` leaves them out of a run's own noise); and
    that divergence (None: the peer chose exact's tokens through `upto`)."""
    import numpy as np

    from kvc.runtime.compare import first_divergence

    own = first_divergence(exact.tokens, peer.tokens)
    end = min(upto, own) if own is not None else upto
    end = min(end, len(exact.logits) - 1, len(peer.logits) - 1)
    error = np.abs(np.stack(exact.logits[:end + 1]).astype(np.float64)
                   - np.stack(peer.logits[:end + 1]).astype(np.float64))
    if own is not None and own <= end and own < len(peer.tokens):
        error[own, [exact.tokens[own], peer.tokens[own]]] = 0.0
    return float(np.max(error[np.isfinite(error)], initial=0.0)), own


def flips_allowed(probes: int, at_least_one: bool = True) -> int:
    """How many of a check's `probes` a graph that selects (a TopK router) may fail its narrow
    bounds on and take a wider one: a router turning to another expert where its reference
    does not (a near-tie the arithmetic decides) moves that probe's logits whatever the drift,
    and such a flip is the exception, while a fault in every token's arithmetic is past the
    narrow bounds on every probe. The one rule of every such excuse: at most a quarter of the
    probes. The compile's blob check and `kvc verify` allow at least one (`few_routers_flipped`,
    `kvc.verify.compiled.few_past_rounding`: their probes are few, 5 to 8, and a correct blob
    flipped one); goldens checked across arithmetics allow none of fewer than four
    (`kvc.verify.goldens`: with one always allowed, goldens of one prompt excused a qwen3_moe
    directory whose layer 1 read layer 0's past)."""
    return max(1 if at_least_one else 0, probes // 4)


def few_routers_flipped(rows: list[dict], excuse: float | None = EXCUSE_FACTOR) -> list[dict]:
    """The rows of one blob check (or one backend of `kvc verify`) of a graph that selects,
    judged by the peer: its wide NRMSE bound is for a blob that flips an expert where the peer
    does not, which moves that probe's logits whatever the arithmetic's drift. Such a flip is
    the exception: on the zoo's mixtures of experts at bf16 (P 128, 5-6 probes each) a correct
    blob was past PEER_FACTOR x the peer's NRMSE on at most one probe (phimoe's 7-token probe,
    4.4x), the others within 0.7-1.2x. A fault in every token's arithmetic is past it on every
    probe: a qwen3_moe generate blob with layer 1's o_proj 30% or 60% too large (NRMSE
    0.025-0.037, 20x the peer's) flipped tokens on three of four probes, each excused as a
    near-tie, and was published. So only `flips_allowed` probes may use the wider bound, and with `excuse` (the compile's blob check) only within that many times the
    peer's NRMSE: a fault confined to one probe's slots (a generate blob reading zeros for the
    values of its last slots, 8.6x the peer's on qwen2_moe, 15x on qwen3_moe) was published by
    the excuse alone. `kvc verify` passes None: its prompts generate 16 tokens, over which a
    correct blob's flipped expert drifted 7-17x the peer's (gpt_oss, qwen3_moe_int4_sym_g16,
    granitemoe_int4_asym_cw, their 1-token prompt), where the compile's probes, of 2 to 8
    tokens, stayed within 4.4x. Every probe past what it may be fails, saying why."""
    judged = [r for r in rows if "peer_nrmse" in r]
    # Past PEER_FACTOR x the peer's own NRMSE, up to the selecting ceiling: where the peer's run
    # flipped the same router (0.061 from the IR's on gpt_oss's 1024-token prompt at P 1024, the
    # blob 0.0613), the non-selecting ceiling of 0.05 counted the blob as flipping alone.
    beyond = [r for r in judged if not r["nrmse"] <= _bound(r["peer_nrmse"], NRMSE_FLOOR, SELECTING_NRMSE_CEILING)]
    allowed = flips_allowed(len(judged))
    for r in beyond:
        bound = _bound(r["peer_nrmse"], NRMSE_FLOOR, SELECTING_NRMSE_CEILING)
        widest = None if excuse is None else min(SELECTING_NRMSE_CEILING, excuse * r["peer_nrmse"])
        if len(beyond) > allowed:
            why = (f"on {len(beyond)} of {len(judged)} probes: a router flipping an expert the plugin's own run does "
                   f"not excuses at most {allowed}")
        elif widest is not None and not r["nrmse"] <= widest:
            why = f"and past the {excuse:g}x ({widest:.3g}) a router flipping an expert excuses"
        else:
            continue
        r["ok"] = False
        r["reason"] = (f"NRMSE {r['nrmse']:.3g} is past {PEER_FACTOR:g}x OpenVINO CPU's own {r['peer_precision']} "
                       f"drift ({bound:.3g}) {why}; {r['reason']}")
    return rows


def peer_for(source, backend: str, config: dict | None, kv_element_types) -> "Peer | None":
    """The peer of runs on `backend` with `config`, for the runs this module judges: OpenVINO
    CPU computing below f32 (`reduced_arithmetic`), with the `source` model's path; else None."""
    from kvc.runtime.compare import reduced_arithmetic

    if source is None or backend != "openvino" or not reduced_arithmetic(backend, config):
        return None
    return Peer(source, config, kv_element_types)


class Peer:
    """The source model on OpenVINO CPU computing as the blobs do (module docstring), compiled
    on first use; its runs are kept by probe, so that `release` can free the compiled model
    before the blobs are imported."""

    def __init__(self, source: Path, import_config: dict, kv_element_types) -> None:
        self.config = {k: v for k, v in import_config.items() if k in _ARITHMETIC}
        kv = next((t for t in kv_element_types if t in _KV_CACHE_PRECISION), None)
        if kv is not None:
            self.config["KV_CACHE_PRECISION"] = _KV_CACHE_PRECISION[kv]
        self.source = source
        self._session = None
        self._runs: dict = {}

    @property
    def precision(self) -> str:
        """The arithmetic as a reason names it: "bf16", or "f32 (activations quantized to 8 bits
        in groups of 32)" (`dynamic_quantization`)."""
        from kvc.runtime.compare import dynamic_quantization

        precision = str(self.config.get("INFERENCE_PRECISION_HINT", "f32"))
        if dynamic_quantization(self.config):
            group = self.config["DYNAMIC_QUANTIZATION_GROUP_SIZE"]
            precision += f" (activations quantized to 8 bits in groups of {group})"
        return precision

    def run(self, prompt, new_tokens: int, origin: int = 0, filled: bool = False, media=None):
        """The peer's greedy run of `prompt` from position `origin`, over a far past with
        `filled`, with the prompt's `media` (`source_run`), its cache kept; each probe run once."""
        from kvc.verify.cache_rows import source_run

        key = (tuple(int(t) for t in prompt), new_tokens, origin, filled, None if media is None else media.key())
        if key not in self._runs:
            if self._session is None:
                from kvc.ir import load
                from kvc.runtime.session import OpenVINOSession

                self._session = OpenVINOSession(load(self.source), "CPU", self.config, exact=False)
            self._runs[key] = source_run(self._session, prompt, new_tokens, origin, filled, media)
        return self._runs[key]

    def prepare(self, probes) -> None:
        """Run each of `probes` (`kvc.verify.compiled.Probe`s) now, then free the compiled source
        model (the runs stay): the blob check does so before it imports the blobs, so that the
        two are never in memory together. A failure is left for `judge` to meet and report."""
        from kvc.errors import KvcError

        try:
            for probe in probes:
                self.run(probe.prompt, probe.new_tokens, probe.origin, probe.filled, probe.media)
        except (KvcError, RuntimeError):
            pass
        self._session = None

    def drift(self, exact, prompt, new_tokens: int, kv, step_bound: float | None, got=None) -> Drift:
        """The peer's run of `prompt` against an exact run of it: the IR's on kvc's interpreter
        (which the compile check proved equal to the source's at f32), its cache compared as
        the blob check compares a blob run's (`judge_run`, over the same layers: all of them
        unless the blob run's `step_bound` is None), or the source's at f32, whose cache is not
        in a static model's layout (logits only). With the judged run `got` when it chose a
        different token than `exact`, the peer's logit noise up to there (`logit_noise`).
        Nothing bounded."""
        from kvc.runtime.compare import first_divergence
        from kvc.verify.compiled import judge_run

        peer = self.run(prompt, new_tokens, getattr(exact, "origin", 0), getattr(exact, "filled", False),
                        getattr(exact, "media", None))
        if not hasattr(exact, "kv_rows"):  # not a static pipeline's run: its cache is the source's layout
            peer = dataclasses.replace(peer, cache=None)
        div = None if got is None else first_divergence(exact.tokens, got.tokens)
        measured_exact, measured_peer = exact, peer
        if div is not None and div + 1 < len(exact.tokens):
            # Over the steps the judged run is measured on: `judge` compares it up to its first
            # divergent token, and a router's flip at that step, diluted over the peer's 16 steps,
            # set a bound a quarter of the same flip's over that one step (gpt_oss at P 1024: the
            # blob and the peer both 0.061 at step 0, the peer 0.014 over 16 steps).
            measured_exact, measured_peer = (dataclasses.replace(g, tokens=g.tokens[:div + 1], logits=g.logits[:div + 1])
                                             for g in (exact, peer))
        # The peer's run as the reference (its cache in the source's layout, as compare_cache
        # reads a reference), the exact run as the run measured: the same distance either way
        # round but for the denominator (the peer's RMS instead of the exact run's).
        unbounded = None if step_bound is None else float("inf")
        row = judge_run(measured_peer, measured_exact, kv, reduced=True, limit=float("inf"), step_bound=unbounded,
                        row_bounds=_UNBOUNDED)
        noise, same = None, False
        if div is not None and div < min(len(got.tokens), len(exact.logits)):
            noise, own = logit_noise(exact, peer, div)
            same = own == div and peer.tokens[div] == got.tokens[div]
        return Drift(float(row["nrmse"]), row.get("cache_error"), self.precision, float(row["step_error"]),
                     noise, same)

    def judge(self, exact, got, prompt, kv, *, limit: float, step_bound: float | None, row_bounds: dict | None = None,
              against: str = "the IR's", reduced: bool = True, selects: bool = False) -> dict:
        """`judge_run`'s verdict on `got` against `exact` by the bounds the peer's drift on the
        same probe sets (module docstring; `limit`, `step_bound` and `row_bounds` the fixed
        policy's, which the peer replaces, and keeps where it cannot run), with what the peer
        measured, in the row and in its reason."""
        from kvc.errors import KvcError
        from kvc.verify.compiled import judge_run

        try:
            drift = self.drift(exact, prompt, len(exact.tokens), kv, step_bound, got)
        except (KvcError, RuntimeError) as exc:
            row = judge_run(exact, got, kv, reduced=reduced, limit=limit, step_bound=step_bound,
                            row_bounds=row_bounds, against=against)
            row["reason"] = (f"{row['reason']} (by the fixed bounds: OpenVINO CPU's own {self.precision} run of "
                             f"the source model, which sets them, failed: {exc})")
            return row
        row = judge_run(exact, got, kv, reduced=reduced, limit=drift.limit(limit, selects),
                        step_bound=drift.step_bound(step_bound),
                        row_bounds=drift.row_bounds(row_bounds, selects) if row_bounds is not None else None,
                        against=against, noise_cap=drift.noise_cap())
        row.update(drift.to_dict())
        row["reason"] = f"{row['reason']}; {drift.describe()}, and bounds this run at {PEER_FACTOR:g}x that"
        return row
