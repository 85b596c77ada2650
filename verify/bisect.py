"""kvc bisect: run the pipeline one pass at a time and find the first pass that changes outputs.

Every intermediate model is evaluated with the probe for its form (`kvc.verify.probe`) on
kvc's numpy runtime and compared with the source model: dynamic stages (the common passes)
by greedy logits over a few steps, static stages (each branch: prefill and the generate
variants) by one step of the NPU contract against the lifted source. The first stage beyond
tolerance (1e-4; NRMSE 0.01 once KV is f16) is reported with the first tensor that diverges:
both models (before and after the pass) run the same input in capture mode and their values
are compared by stable name, in topological order.

static-shape and mask-positions are judged together: under the NPU contract cache slots
stop being positions the moment shapes become static, and mask-positions is what restores a
sliding window's meaning, so the pair is the unit that must preserve numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import openvino as ov

from kvc.export.build import StaticOptions
from kvc.passes import PassManager, parse_pipeline
from kvc.runtime.compare import F16_NRMSE, F32_ATOL, max_abs, nonfinite_mismatch, nrmse
from kvc.runtime.generate import first_step_feed
from kvc.runtime.session import NumpySession
from kvc.verify.probe import dynamic_logits, is_static, static_feed


@dataclass
class Stage:
    branch: str
    index: int
    spec: str
    max_abs: float
    nrmse: float
    ok: bool


@dataclass
class BisectReport:
    stages: list[Stage] = field(default_factory=list)
    first_bad: Stage | None = None
    first_tensor: dict | None = None

    @property
    def ok(self) -> bool:
        return self.first_bad is None

    def to_dict(self) -> dict:
        return {"ok": self.ok, "stages": [asdict(s) for s in self.stages],
                "first_bad_pass": asdict(self.first_bad) if self.first_bad else None,
                "first_diverging_tensor": self.first_tensor}


def _judge(ref: np.ndarray, got: np.ndarray, f16: bool) -> tuple[float, float, bool]:
    """Metrics and whether they pass; a NaN/Inf that the reference lacks always fails."""
    a, n = max_abs(ref, got), nrmse(ref, got)
    finite = nonfinite_mismatch(ref, got) is None
    return a, n, finite and ((n <= F16_NRMSE) if f16 else (a <= F32_ATOL))


def bisect(model: ov.Model, options: StaticOptions = StaticOptions(), *, prompt=None, steps: int = 3,
           seed: int = 0) -> BisectReport:
    """Walk the common passes and then every branch of `options`; stop at the first bad pass."""
    from kvc.export.build import branch_pipelines

    source = model.clone()
    vocab = model.output("logits").get_partial_shape()[-1].get_length()
    rng = np.random.default_rng(seed)
    prompt = list(prompt) if prompt is not None else rng.integers(1, vocab, 8).tolist()
    ref_dynamic = dynamic_logits(source, prompt, steps)
    report = BisectReport()
    current = model
    common = parse_pipeline(options.common_pipeline())
    for i, p in enumerate(common, start=1):
        before = current.clone()
        current = PassManager([p], use_env=False).run(current).model
        got = dynamic_logits(current, prompt, steps)
        a, n, ok = _judge(ref_dynamic, got, f16=False)
        stage = Stage("common", i, p.spec(), a, n, ok)
        report.stages.append(stage)
        if not ok:
            report.first_bad = stage
            report.first_tensor = first_diverging_tensor(before, current, lambda s: first_step_feed(s, prompt))
            return report
    lifted = current
    tokens = rng.integers(1, vocab, 4 * options.plan().capacity)
    for branch, pipeline in branch_pipelines(options).items():
        model_b = lifted.clone()
        passes = parse_pipeline(pipeline)
        pending = ""
        for i, p in enumerate(passes, start=1):
            before = model_b.clone()
            model_b = PassManager([p], use_env=False).run(model_b).model
            paired = p.name == "static-shape" and i < len(passes) and passes[i].name == "mask-positions"
            if paired or not is_static(model_b):
                pending += p.spec() + "+"
                continue  # judged with the next pass (see the module docstring)
            feed = static_feed(model_b, lifted, tokens)
            out = NumpySession(model_b).infer(feed.inputs)["logits"][0][feed.rows]
            a, n, ok = _judge(feed.ref_logits, out, feed.f16)
            stage = Stage(branch, i, pending + p.spec(), a, n, ok)
            pending = ""
            report.stages.append(stage)
            if not ok:
                report.first_bad = stage
                if is_static(before):
                    report.first_tensor = first_diverging_tensor(
                        before, model_b, lambda s: static_feed(s.interpreter.model, lifted, tokens).inputs)
                return report
    return report


def first_diverging_tensor(before: ov.Model, after: ov.Model, feed_for) -> dict | None:
    """The first value (in `after`'s topological order) whose numbers differ from the
    same-named value of `before`, both run on the same logical input (`feed_for(session)`)."""
    sessions = NumpySession(before), NumpySession(after)
    (_, a_vals), (_, b_vals) = (s.capture(feed_for(s)) for s in sessions)
    for name, value in b_vals.items():
        ref = a_vals.get(name)
        if ref is None or np.shape(ref) != np.shape(value):
            continue
        r, v = np.asarray(ref), np.asarray(value)
        if r.dtype == np.bool_ or v.dtype == np.bool_:
            differs, delta = bool(np.any(r != v)), float(np.sum(r != v))
        else:
            delta = float(np.max(np.abs(r.astype(np.float64) - v.astype(np.float64)))) if r.size else 0.0
            differs = delta > F32_ATOL or (r.size > 0 and nonfinite_mismatch(r, v) is not None)
        if differs:
            return {"tensor": name, "max_abs": delta, "shape": list(np.shape(value))}
    return None
