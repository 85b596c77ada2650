"""`kvc plan`: the lengths, prefill chunk and generate variants that serve a workload fastest.

Inputs:

* a workload: prompt and response lengths, from a requests file (`kvc run --requests`'s JSONL;
  text prompts tokenized with the model's tokenizer) or a histogram (JSON:
  ``{"requests": [[prompt_len, response_len, count], ...]}``);
* the cost of the static models on the target (`Costs`): milliseconds of a prefill call by
  the tokens it takes (and of a first-chunk call, which reads no past), of a generate step by
  the variant size, seconds to compile a model and bytes it holds once compiled. Measured by
  kvc on this machine (`measure_costs`: real static models of the model at a few sizes,
  compiled for the device and timed), cached, or given;
* a budget: models (blobs per device, the prefill counted; on the CPU every prefill model,
  chunk, bulk and first chunks, is one blob: `blobs`), compile seconds, device memory.

The model of a request of n prompt and m new tokens (the runtime's rules,
kvc.runtime.static_pipeline): the prefill costs the calls `prefill_calls` makes (ceil(n / C)
calls of C tokens with one chunk, bulk and first-chunk calls where they save rows; one call of
P tokens without a chunk); decode step k (k = 1..m-1) runs on the smallest variant T with
T >= n + R and T >= n + k. Costs between measured sizes are interpolated linearly and made
non-decreasing in size (a larger call or variant does not cost less; a measurement that says
otherwise is noise, and would make a plan look worse than a larger configuration). P is the
smallest multiple of 64 (and of every chunk) that takes every prompt, R the smallest that gives every
request its tokens (P + R >= n + m - 1), so no request of the workload is refused. The plan
minimizes the mean time per request (TTFT + decode) over the chunk and the variant set within
the budget, and is printed beside `single` and `pyramid` as a user gets them without it: the
default chunks, and the default P and R when they serve the workload. A plan file (`-o
plan.json`) is what `kvc compile --plan` reads.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvc import jsontext
from kvc.errors import UsageError
from kvc.plan import MAX_LENGTH, NPUW_ALIGN, plan_lengths

PLAN_FORMAT = "kvc-plan/1"
COSTS_FORMAT = "kvc-costs/1"
MAX_VARIANT_CANDIDATES = 40


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


# -- workloads -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    prompts: np.ndarray  # prompt lengths, one per request
    responses: np.ndarray  # new tokens, one per request
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.prompts) == 0:
            raise UsageError(f"{self.source or 'the workload'}: no requests")

    def summary(self) -> dict:
        return {"source": self.source, "requests": int(len(self.prompts)),
                "prompt_tokens": {"mean": float(self.prompts.mean()), "max": int(self.prompts.max())},
                "new_tokens": {"mean": float(self.responses.mean()), "max": int(self.responses.max())}}


MAX_REQUESTS = 1_000_000  # requests a workload may hold, a histogram's counts summed
MAX_MS = 1e9  # the longest time a costs file may state (11 days): its sums stay finite


def load_workload(path: str | Path, encode=None) -> Workload:
    """A requests file (.jsonl) or a histogram (.json), checked; `encode` tokenizes text prompts."""
    path = Path(path)
    if path.suffix == ".json":
        return _histogram(path)
    from kvc.cache.requests import Request, read_requests

    prompts, responses = [], []
    for entry in read_requests(path):
        if not isinstance(entry, Request):
            continue
        if entry.prompt_ids is not None:
            n = len(entry.prompt_ids)
        elif encode is None:
            raise UsageError(f"{path}:{entry.line}: a text prompt needs the model's tokenizer (tokenizer.json)")
        else:
            n = len(encode(entry.prompt))
        prompts.append(n)
        responses.append(entry.max_new_tokens)
    return Workload(np.asarray(prompts, np.int64), np.asarray(responses, np.int64), str(path))


def _histogram(path: Path) -> Workload:
    try:
        data = jsontext.loads(jsontext.read_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable JSON histogram ({exc})") from None
    rows = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise UsageError(f'{path}: expected {{"requests": [[prompt_len, response_len, count], ...]}}')
    total = 0
    for i, row in enumerate(rows):
        ok = (isinstance(row, list) and len(row) == 3
              and all(isinstance(v, int) and not isinstance(v, bool) for v in row)
              and 1 <= row[0] <= MAX_LENGTH and 1 <= row[1] <= MAX_LENGTH and 1 <= row[2] <= MAX_REQUESTS)
        if not ok:
            raise UsageError(f"{path}: requests[{i}] must be [prompt_len 1-{MAX_LENGTH}, response_len 1-{MAX_LENGTH}, "
                             f"count 1-{MAX_REQUESTS}], found {json.dumps(row)[:60]}")
        total += row[2]
        if total > MAX_REQUESTS:  # 200000 rows of 1e6 each ran the machine out of memory
            raise UsageError(f"{path}: the histogram counts more than {MAX_REQUESTS} requests in all (by "
                             f"requests[{i}]); scale its counts down, the plan depends on their proportions")
    counts = [row[2] for row in rows]
    return Workload(np.repeat(np.asarray([row[0] for row in rows], np.int64), counts),
                    np.repeat(np.asarray([row[1] for row in rows], np.int64), counts), str(path))


# -- costs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Costs:
    """Measured (or given) costs on one target: points of a piecewise-linear model."""

    call_ms: dict  # tokens per prefill call -> ms
    step_ms: dict  # generate variant size -> ms per step
    compile_s: float = 0.0  # seconds to compile one static model
    model_bytes: int = 0  # bytes one compiled model holds on the device (packed weights)
    target: dict = field(default_factory=dict)  # device, precision, OpenVINO version, model hashes
    # tokens per first-chunk call (no past) -> ms; without it (costs measured before kvc
    # measured them) a first call is costed as a chunk call of its tokens
    first_ms: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Every time a positive number below MAX_MS (zeros divided by zero, 1e308 summed to
        infinity, NaN was written back as bare NaN), no boolean, sizes >= 1; compile seconds
        and model bytes non-negative and finite; the target an object."""
        def number(v, low: float, high: float, strict: bool = False) -> bool:
            return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    and (v > low if strict else v >= low) and v <= high)

        for name in ("call_ms", "step_ms", "first_ms"):
            points = getattr(self, name)
            if not isinstance(points, dict) or (not points and name != "first_ms") or not all(
                    isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_LENGTH
                    and number(v, 0.0, MAX_MS, strict=True) for k, v in points.items()):
                raise UsageError(f"costs: {name} must map sizes 1-{MAX_LENGTH} to milliseconds above 0 and at most "
                                 f"{MAX_MS:g}, found {str(points)[:120]}")
        if not number(self.compile_s, 0.0, MAX_MS) or not number(self.model_bytes, 0, 2 ** 53):
            raise UsageError(f"costs: compile_s and model_bytes must be finite and not negative, found "
                             f"{self.compile_s!r} and {self.model_bytes!r}")
        if not isinstance(self.target, dict):
            raise UsageError(f"costs: target must be an object, found {type(self.target).__name__}")

    def call(self, tokens) -> np.ndarray:
        return _interpolate(self.call_ms, tokens)

    def step(self, size) -> np.ndarray:
        return _interpolate(self.step_ms, size)

    def first(self, tokens) -> np.ndarray:
        return _interpolate(self.first_ms, tokens) if self.first_ms else self.call(tokens)

    def to_dict(self) -> dict:
        first = {"first_ms": {str(k): v for k, v in sorted(self.first_ms.items())}} if self.first_ms else {}
        return {"format": COSTS_FORMAT, "call_ms": {str(k): v for k, v in sorted(self.call_ms.items())},
                "step_ms": {str(k): v for k, v in sorted(self.step_ms.items())}, **first,
                "compile_s": self.compile_s, "model_bytes": self.model_bytes, "target": self.target}

    @classmethod
    def from_dict(cls, d, where: str = "costs") -> "Costs":
        if not isinstance(d, dict) or d.get("format") != COSTS_FORMAT:
            raise UsageError(f"{where}: not a kvc costs file (format {COSTS_FORMAT})")
        try:  # keys are strings in JSON; values are taken as written, so a boolean is refused
            return cls({int(k): v for k, v in d["call_ms"].items()}, {int(k): v for k, v in d["step_ms"].items()},
                       d.get("compile_s", 0.0), d.get("model_bytes", 0), d.get("target", {}),
                       {int(k): v for k, v in d.get("first_ms", {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UsageError(f"{where}: malformed costs ({type(exc).__name__}: {exc})") from None


def _interpolate(points: dict, x) -> np.ndarray:
    xs = np.array(sorted(points), np.float64)
    # non-decreasing in size: a larger call or variant does not cost less (what says otherwise is noise)
    ys = np.maximum.accumulate(np.array([points[k] for k in sorted(points)], np.float64))
    x = np.asarray(x, np.float64)
    if len(xs) == 1:
        return np.full_like(x, ys[0])
    y = np.interp(x, xs, ys)
    hi = x > xs[-1]
    y = np.where(hi, ys[-1] + (x - xs[-1]) * max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])), y)
    lo = x < xs[0]
    return np.where(lo, np.maximum(0.0, ys[0] - (xs[0] - x) * max(0.0, (ys[1] - ys[0]) / (xs[1] - xs[0]))), y)


def measure_costs(model, device: str = "CPU", precision: str = "auto", progress=None, repeats: int = 7) -> Costs:
    """Build the model's static prefill at three chunk sizes, with a first chunk of the same
    rows each (no past; of dynamic rows where `kvc compile` builds one, `first_rows`, timed on
    that many rows), and generate models at three sizes (within the positions it was built
    for), compile each for `device` as `kvc compile` does, and time its calls: the fastest of
    `repeats` after one warm-up (on a shared machine the other runs measure the neighbours: a
    median once read a 256 step as 36 ms where the pipeline runs it in 21)."""
    from kvc.export.build import build_static
    from kvc.export.compile import auto_cache, device_config, model_max_positions
    from kvc.export.manifest import openvino_version, source_hashes
    from kvc.export.mapped import status_bytes
    from kvc.ir.reader import core, load, resolve
    from kvc.plan import StaticOptions
    from kvc.runtime.session import array_dtype, shared_tensor

    say = progress or (lambda message: None)
    path = Path(model)
    stated = model_max_positions(resolve(path).root)
    top = min(2048, stated[1] if stated else 2048)
    P = R = max(NPUW_ALIGN, top // 2 // NPUW_ALIGN * NPUW_ALIGN)
    chunks = sorted({c for c in (32, 128, 512) if c <= P})
    sizes = sorted({min(256, P + R), (P + R) // 2 // NPUW_ALIGN * NPUW_ALIGN or P + R, P + R})
    config = device_config(device, for_export=False, precision=precision)
    cache = auto_cache(device, precision)  # the KV type and attention `kvc compile` builds
    call_ms, first_ms, step_ms, compile_s, model_bytes = {}, {}, {}, [], []
    default_rows = first_rows(device, precision, path)  # as kvc compile builds them for this model
    for i, chunk in enumerate(chunks):
        chunked = chunk < P
        rows = default_rows if chunked else "static"
        options = StaticOptions(max_prompt_len=P, min_response_len=R, prefill_chunk_size=chunk if chunked else 0,
                                prefill_first=(chunk,) if chunked else (), prefill_first_rows=rows,
                                variants=tuple(sizes) if i == 0 else "single", **cache)
        static = build_static(load(path), options, use_env=False)
        names = ["prefill", *([f"first-{chunk}"] if chunked else []),
                 *([f"generate-{s}" for s in sizes] if i == 0 else [])]
        for name in names:
            say(f"measuring: {name} (chunk {chunk})" if name == "prefill" else f"measuring: {name}")
            before = status_bytes("VmRSS")
            started = time.perf_counter()
            compiled = core().compile_model(static.models[name], device, config)
            compile_s.append(time.perf_counter() - started)
            model_bytes.append(max(0, status_bytes("VmRSS") - before))
            request = compiled.create_infer_request()
            inputs = []  # the arrays the request's tensors share: alive until the request is gone
            for port in compiled.inputs:  # set once, as the pipeline binds its buffers: no copy per call
                shape = [chunk if d.is_dynamic else d.get_length() for d in port.get_partial_shape()]  # dynamic rows
                value = np.zeros(shape, array_dtype(port.get_element_type()))
                if port.get_any_name() == "attention_mask":
                    value[..., -1:] = 1
                inputs.append(value)
                request.set_tensor(port, shared_tensor(value))
            times = []
            for r in range(repeats + 1):
                started = time.perf_counter()
                request.infer()
                if r:
                    times.append(1e3 * (time.perf_counter() - started))
            if name == "prefill":
                call_ms[chunk] = float(min(times))
            elif name.startswith("first-"):
                first_ms[chunk] = float(min(times))
            else:
                step_ms[int(name.split("-")[1])] = float(min(times))
            del request, compiled, inputs
        del static
    target = {"device": device, "precision": precision, **cache, "first_rows": default_rows,
              "openvino": openvino_version(),
              "model": source_hashes(path)}
    return Costs(call_ms, step_ms, float(np.median(compile_s)), int(np.median(model_bytes)), target, first_ms)


def first_rows(device: str, precision: str, model=None) -> str:
    """The rows of the first chunks `kvc compile` builds for `device` at `precision` with its
    defaults (--prefill-chunk-size and --prefill-first-rows auto): "dynamic" on an f32 CPU,
    else "static", and static for a `model` that selects (`source_selects`)."""
    from kvc.export.compile import resolve_chunk, resolve_first_rows, source_selects

    selects = model is not None and source_selects(model)
    return resolve_first_rows("auto", (device,), precision, resolve_chunk("auto", (device,), precision), selects)


# -- the model of a request ----------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    max_models: int = 2  # blobs per device, the prefill counted: one prefill and one generate, as NPUW's default
    max_compile_s: float | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_models < 2:
            raise UsageError(f"the budget must allow at least 2 models (a prefill and a generate), got "
                             f"{self.max_models}")


@dataclass(frozen=True)
class Candidate:
    name: str
    prompt: int
    response: int
    chunk: int
    sizes: tuple[int, ...]
    ttft_ms: float
    decode_ms: float
    models: int  # blobs per device: an If chain of first chunks (CPU) is one (`blobs`)
    compile_s: float
    model_bytes: int
    bulk: tuple[int, ...] = ()  # bulk prefill chunks
    first: tuple[int, ...] = ()  # first chunks
    first_dynamic: bool = False  # the one first chunk takes 1 to F rows (--prefill-first-rows dynamic)

    @property
    def chunks(self) -> int | list[int]:
        """--prefill-chunk-size as a plan file states it: the chunk, or it and the bulk chunks."""
        return [self.chunk, *self.bulk] if self.bulk else self.chunk

    @property
    def request_ms(self) -> float:
        return self.ttft_ms + self.decode_ms

    def to_dict(self) -> dict:
        return {"name": self.name, "max_prompt_len": self.prompt, "min_response_len": self.response,
                "prefill_chunk_size": self.chunks, "prefill_first": list(self.first),
                **({"prefill_first_rows": "dynamic"} if self.first_dynamic else {}), "variants": list(self.sizes),
                "expected_ms": {"ttft": self.ttft_ms, "decode": self.decode_ms, "request": self.request_ms},
                "models": self.models, "compile_s": self.compile_s, "model_bytes": self.model_bytes}


def lengths_for(workload: Workload, chunks: int | tuple[int, ...]) -> tuple[int, int]:
    """P and R (aligned as NPUW aligns them, and P to every chunk as plan_lengths does) that
    serve every request of the workload."""
    P = _align(int(workload.prompts.max()), max(NPUW_ALIGN, *(chunks if isinstance(chunks, tuple) else (chunks,))))
    need = int((workload.prompts + workload.responses - 1).max())
    R = max(NPUW_ALIGN, _align(need - P, NPUW_ALIGN))
    return P, R


def prefill_ms(workload: Workload, costs: Costs, P: int, chunk: int, bulk: tuple[int, ...] = (),
               first: tuple[int, ...] = (), dynamic: bool = False) -> float:
    """Mean prefill time: the calls the runtime makes for each prompt (`prefill_calls`), a
    first chunk's at its own cost (`Costs.first`): F rows, or with `dynamic` rows the rows the
    call computes (a first chunk of dynamic rows takes a prompt's first 1 to F tokens
    unpadded; its cost is interpolated from the first chunks `measure_costs` times)."""
    from kvc.runtime.static_pipeline import prefill_calls

    if not chunk or chunk >= P:
        return float(costs.call(P))
    lengths, counts = np.unique(workload.prompts, return_counts=True)
    ms = {(c, False): float(costs.call(c)) for c in (chunk, *bulk)}
    rows = sorted({min(f, int(n)) for f in first for n in lengths} if dynamic else set(first))
    ms |= {(r, True): float(c) for r, c in zip(rows, costs.first(rows))}
    per_length = [sum(ms[(call.end - call.begin) if call.first and dynamic else call.size, call.first]
                      for call in prefill_calls(0, int(n), (), P, (chunk, *bulk), first, dynamic))
                  for n in lengths]
    return float(np.dot(per_length, counts) / counts.sum())


def blobs(bulk: tuple[int, ...], first: tuple[int, ...], sizes, device: str) -> tuple[int, int]:
    """(static models, blobs) of a configuration on `device`: the prefill, its bulk and first
    chunks and the generate variants are a model each; on the CPU the prefill models compile as
    one If blob, their weights packed once (kvc.export.branches.branch_chain, the rule kvc
    compile groups by). Compiling costs every model (an If compiles each body); device memory
    and the budget's models count blobs."""
    from kvc.export.branches import branch_chain

    prefills = ["prefill", *(f"prefill-{b}" for b in bulk), *(f"first-{f}" for f in first)]
    group = branch_chain(prefills, device)
    models = len(prefills) + len(sizes)
    return models, models - max(0, len(group) - 1)


def decode_ms(workload: Workload, costs: Costs, R: int, sizes) -> float:
    """Mean decode time: step k on the smallest size >= max(n + R, n + k), k = 1..m-1."""
    sizes = np.asarray(sorted(sizes), np.int64)
    top = int(sizes[-1])
    x = np.arange(top + 1)
    variant = sizes[np.minimum(np.searchsorted(sizes, x), len(sizes) - 1)]
    cum = np.concatenate([[0.0], np.cumsum(costs.step(variant))])  # cum[x + 1] = sum of step(S(y)) for y <= x
    n, m = workload.prompts, workload.responses
    start = np.minimum(n + R, top)
    first = np.minimum(m - 1, R)  # steps k = 1..R run on S(n + R)
    total = first * costs.step(variant[start])
    last = np.minimum(n + m - 1, top)  # steps k = R+1..m-1 run on S(n + k)
    later = np.where(m - 1 > R, cum[last + 1] - cum[np.minimum(n + R, top) + 1], 0.0)
    return float(np.mean(total + later))


def evaluate(name: str, workload: Workload, costs: Costs, chunk: int | tuple[int, ...], variants,
             lengths: tuple[int, int] | None = None, first: tuple[int, ...] = (), device: str = "CPU",
             first_rows: str = "static") -> Candidate:
    """`chunk`: one size, or the chunk and its bulk chunks (as --prefill-chunk-size); `first`:
    the first chunks (as --prefill-first; those plan_lengths drops are dropped), of
    `first_rows` (as --prefill-first-rows, resolved)."""
    sizes = chunk if isinstance(chunk, tuple) else (chunk,)
    P, R = lengths or lengths_for(workload, sizes)
    L = plan_lengths(P, R, sizes if sizes[0] < P else 0, variants, first=first,
                     first_rows=first_rows if len(first) <= 1 else "static")
    models, blob_count = blobs(L.bulk, L.first, L.sizes, device)
    return Candidate(name, L.prompt, L.response, L.chunk, L.sizes,
                     prefill_ms(workload, costs, L.prompt, L.chunk, L.bulk, L.first, L.first_dynamic),
                     decode_ms(workload, costs, L.response, L.sizes), blob_count, models * costs.compile_s,
                     blob_count * costs.model_bytes, L.bulk, L.first, L.first_dynamic)


def best_plan(workload: Workload, costs: Costs, budget: Budget = Budget(), default_chunk: int | tuple[int, ...] = 0,
              max_positions: int | None = None, default_first: tuple[int, ...] = (), device: str = "CPU",
              first_rows: str = "static") -> dict:
    """The fastest candidate within the budget, and `single` and `pyramid` as a user gets them
    without a plan: the default chunk and first chunks, and the default lengths (P 1024, R 128,
    P lowered to fit the model's `max_positions` as kvc compile lowers it) when they serve every
    request of the workload, else the workload's. The search takes at most one bulk chunk and at
    most one first chunk, of the chunk's or the bulk chunk's rows (on the CPU all in one blob:
    `blobs`), of `first_rows` (--prefill-first-rows, resolved: "dynamic" on an f32 CPU, where
    `kvc compile` builds a first chunk that computes a prompt's first 1 to F tokens unpadded,
    so the plan costs it as the compile builds it)."""
    fitted = plan_lengths(None, None, default_chunk, "single", max_positions=max_positions)  # as compile fits them
    serves = (int(workload.prompts.max()) <= fitted.prompt
              and int((workload.prompts + workload.responses - 1).max()) <= fitted.prompt + fitted.response)
    defaults = (fitted.prompt, fitted.response) if serves else None
    baselines = [evaluate(v, workload, costs, default_chunk, v, defaults, default_first, device, first_rows)
                 for v in ("single", "pyramid")]
    best = None
    decode = functools.cache(lambda R, sizes: decode_ms(workload, costs, R, sizes))  # the same for every prefill
    P0 = _align(int(workload.prompts.max()), NPUW_ALIGN)
    chunks = [0] + [1 << k for k in range(4, 16) if (1 << k) < P0]
    for chunk in chunks:
        below = lengths_for(workload, chunk)[0]  # a bulk chunk must leave a past
        bulks = [()] + [(b,) for b in (chunk << k for k in range(1, 16)) if chunk and b < below]  # one at most
        for bulk in bulks:
            P, R = lengths_for(workload, (chunk, *bulk))
            top = P + R
            candidates = list(range(2 * NPUW_ALIGN, top, NPUW_ALIGN))
            if len(candidates) > MAX_VARIANT_CANDIDATES:  # sizes where requests start: quantiles of n + R
                q = np.quantile(workload.prompts + R, np.linspace(0, 1, MAX_VARIANT_CANDIDATES))
                candidates = sorted({min(top - NPUW_ALIGN, _align(int(v), NPUW_ALIGN)) for v in q} - {top})
            for first in [(), *((x,) for x in (chunk, *bulk) if 0 < chunk < P)]:
                prefill = prefill_ms(workload, costs, P, chunk if chunk < P else 0, bulk, first,
                                     first_rows == "dynamic" and bool(first))
                for extra in range(0, budget.max_models):
                    if not _fits(budget, costs, *blobs(bulk, first, (0,) * (extra + 1), device)):
                        break
                    for combo in itertools.combinations(candidates, extra):
                        sizes = (*combo, top)
                        ms = prefill + decode(R, sizes)
                        if best is None or ms < best[0] - 1e-9:
                            best = (ms, (chunk, *bulk), sizes, first, P)
    if best is None:
        raise UsageError("no plan fits the budget: even one prefill and one generate model exceed it")
    ms, chunk, sizes, first, P = best
    plan = evaluate("plan", workload, costs, chunk, sizes, first=first, device=device, first_rows=first_rows)
    searched = (P, chunk[0] if chunk[0] < P else 0, chunk[1:], first, sizes, ms)
    built = (plan.prompt, plan.chunk, plan.bulk, plan.first, plan.sizes, plan.request_ms)
    if searched[:-1] != built[:-1] or not math.isclose(ms, plan.request_ms, rel_tol=1e-9):
        raise RuntimeError(f"internal error: the plan's search chose P, chunk, bulk, first, variants, ms {searched}; "
                           f"kvc compile would build {built}")
    return {"plan": plan, "baselines": baselines}


def _fits(budget: Budget, costs: Costs, models: int, blob_count: int) -> bool:
    """Whether `models` static models in `blob_count` blobs (`blobs`) keep the budget."""
    return (blob_count <= budget.max_models
            and (budget.max_compile_s is None or models * costs.compile_s <= budget.max_compile_s)
            and (budget.max_bytes is None or blob_count * costs.model_bytes <= budget.max_bytes))


def plan_document(result: dict, workload: Workload, costs: Costs, budget: Budget) -> dict:
    """The plan file `kvc compile --plan` reads (and `kvc plan --json` prints)."""
    plan = result["plan"]
    return {"format": PLAN_FORMAT, "lengths": {k: v for k, v in plan.to_dict().items()
                                                  if k in ("max_prompt_len", "min_response_len",
                                                           "prefill_chunk_size", "prefill_first", "variants")},
            "expected": plan.to_dict(), "against": [b.to_dict() for b in result["baselines"]],
            "workload": workload.summary(), "budget": dataclasses.asdict(budget), "costs": costs.to_dict()}


def read_plan(path: str | Path) -> dict:
    """The lengths of a plan file, checked: max_prompt_len, min_response_len, prefill_chunk_size,
    prefill_first (a plan written before kvc planned first chunks has none: none), variants."""
    path = Path(path)
    try:
        data = jsontext.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable plan ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT or not isinstance(data.get("lengths"), dict):
        raise UsageError(f"{path}: not a kvc plan (format {PLAN_FORMAT}; write one with kvc plan -o)")
    L = data["lengths"]
    ints = ("max_prompt_len", "min_response_len")
    chunk = L.get("prefill_chunk_size")
    chunk = tuple(chunk) if isinstance(chunk, list) and chunk else chunk  # the chunk and its bulk chunks

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    first = L.get("prefill_first", [])
    if (not all(count(L.get(k)) for k in ints)
            or not (count(chunk) or (isinstance(chunk, tuple) and all(count(c) for c in chunk)))
            or not isinstance(first, list) or not all(count(f) and f > 0 for f in first)
            or not isinstance(L.get("variants"), list) or not L["variants"]
            or not all(count(v) and v > 1 for v in L["variants"])):
        raise UsageError(f"{path}: malformed lengths {json.dumps(L)[:120]}")
    try:
        plan_lengths(L["max_prompt_len"], L["min_response_len"], chunk, tuple(L["variants"]), first=tuple(first))
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from None
    return {**{k: L[k] for k in ints}, "prefill_chunk_size": chunk, "prefill_first": tuple(first),
            "variants": tuple(L["variants"])}
