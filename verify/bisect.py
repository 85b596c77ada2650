"""kvc bisect: run the pipeline one pass at a time and name the one pass that breaks the outputs.

Every intermediate model is evaluated with the probe for its form (`kvc.verify.probe`) on
kvc's numpy runtime and compared with the source model: dynamic stages (the common passes)
by greedy logits over a few steps, static stages (each branch: prefill and the generate
variants) by steps of the NPU contract against the lifted source (`static_cases`: the past
half full, empty and full, a call full and of one token, so that the last slots and positions
a model has and its pad rows are run, as the compile's probes run them; a first chunk of
dynamic rows on calls of 1 to F rows), the logits and the cache rows each step writes (its
present outputs' new rows against the source's for the same positions: a step that wrote one
layer's keys and values into each other's buffers had the right logits). Each pass is judged on
its own (tolerance 1e-4; NRMSE 0.01 once KV is f16). A mixture of experts is judged again
with every router forced on both sides (kvc.verify.experts), as the compile judges it, so that
an expert the probe's router never picks is run too: a step runs again with its forced
positions shifted by its rows until they span every round of experts (`_forced_static`).

The pass named is the first one after which the outputs are wrong *and stay wrong* to the end
of its branch. A pass may break numbers that a later pass is there to restore: under the NPU
contract cache slots stop being positions the moment shapes become static, and
mask-positions is what gives a sliding window its meaning back, so on such a model
static-shape alone diverges and the table shows it as "restored". With the pass, the first
tensor that diverges: both models (before and after it) run the same input in capture mode
and their values are compared by stable name, in topological order (when the model before
it is static too; static-shape itself changes every shape, so there is no tensor to pair).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import openvino as ov

from kvc.passes import PassFailure, PassManager
from kvc.plan import StaticOptions
from kvc.runtime.compare import F16_NRMSE, f32_bound, max_abs, nonfinite_mismatch, nrmse
from kvc.runtime.generate import first_step_feed
from kvc.verify.embedding import model_differs, source_table
from kvc.verify.experts import ROUND_STEPS, ROUTER_SHIFT, experts_of, force_routers, forced_routing, rounds
from kvc.verify.weights import model_differs as weights_differ
from kvc.verify.weights import weights_of
from kvc.verify.probe import (dynamic_logits, dynamic_rows, is_static, session_for, static_cases, static_feed,
                              written_rows)


@dataclass
class Stage:
    branch: str
    index: int
    spec: str
    max_abs: float
    nrmse: float
    ok: bool
    restored: bool = False  # wrong after this pass, right again after a later one of its branch
    reason: str = ""  # what else is wrong: the embedding table or a weight (verify/weights.py)
    probe: str = ""  # a static stage: the step it first failed on ("n tokens over k cached")


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
    return a, n, finite and ((n <= F16_NRMSE) if f16 else (a <= f32_bound(ref)))


def bisect(model: ov.Model, options: StaticOptions = StaticOptions(), *, prompt=None, steps: int = 3,
           seed: int = 0, file: str = "<model>") -> BisectReport:
    """Walk the common passes and then every branch of `options`; stop at the first bad pass.
    `file` names the model in errors."""
    try:
        return _bisect(model, options, prompt, steps, seed, file)
    except PassFailure as exc:
        raise exc.in_file(file) from None


def _bisect(model: ov.Model, options: StaticOptions, prompt, steps: int, seed: int, file: str) -> BisectReport:
    from kvc.errors import PassError, UsageError
    from kvc.export.build import branch_passes, common_passes

    source = model.clone()
    logits = next((o for o in model.outputs if "logits" in o.get_names()), None)
    if logits is None or logits.get_partial_shape().rank.is_dynamic or logits.get_partial_shape()[-1].is_dynamic:
        found = ", ".join(sorted(n for o in model.outputs for n in o.get_names())) or "none"
        raise PassError(f"{file}: not a causal language model: kvc bisects models with an output named logits "
                        f"[.., V] of known vocabulary size; found outputs {found}")
    vocab = logits.get_partial_shape()[-1].get_length()
    rng = np.random.default_rng(seed)
    prompt = list(prompt) if prompt is not None else rng.integers(1, vocab, 8).tolist()
    outside = [t for t in prompt if not 0 <= t < vocab]
    if outside:
        raise UsageError(f"token id {outside[0]} of --prompt-ids is outside the vocabulary (ids 0 to {vocab - 1})")
    ref_dynamic = dynamic_logits(source, prompt, steps)
    experts = experts_of(source)
    ref_forced = dynamic_logits(force_routers(source.clone()), prompt, steps) if experts else None
    report = BisectReport()
    # The embedding rows the probe's tokens do not select, and the experts its router does not
    # pick, are compared whole after every pass.
    unread = _Unread(source)
    current = model
    for i, p in enumerate(common_passes(options), start=1):
        before = current.clone()
        current = PassManager([p], use_env=False).run(current).model
        a, n, ok = _judge(ref_dynamic, dynamic_logits(current, prompt, steps), f16=False)
        why = unread.changed(current)
        if experts and why is None:
            fa, fn, fok = _judge(ref_forced, dynamic_logits(force_routers(current.clone()), prompt, steps), f16=False)
            why = None if fok else _forced_reason(experts, fa, fn)
        stage = Stage("common", i, p.spec(), a, n, ok and why is None, reason=why or "")
        report.stages.append(stage)
        if not stage.ok:
            report.first_bad = stage
            report.first_tensor = first_diverging_tensor(before, current, lambda s: first_step_feed(s, prompt))
            return report
    lifted = current
    tokens = rng.integers(1, vocab, 4 * options.lengths().capacity)
    for branch, passes in branch_passes(options).items():
        if _bisect_branch(report, branch, passes, lifted, tokens, unread, experts):
            return report
    return report


def _forced_reason(experts: tuple[int, int], a: float, n: float) -> str:
    return f"with {forced_routing(experts)}, the logits differ (max abs {a:.3g}, NRMSE {n:.3g})"


def _forced_static(model: ov.Model, lifted: ov.Model, tokens, experts: tuple[int, int], refs: dict) -> str | None:
    """Why a static stage differs from the lifted source with both forced alike
    (kvc.verify.experts), or None: its step, run again with the forced positions shifted by
    the step's own rows until they span every round of experts (`rounds`: with k 2 of an even
    E, every pair of experts in either slot; at most ROUND_STEPS positions, as the compile's
    forced probe). Over one round alone (2 ceil(E / k) - 1 positions) a generate model never
    put experts 0 and 5 together on qwen2_moe, and a graph that moved 5's routing weight to 6
    only for that pair was 'no pass changes the outputs'."""
    count, per_token = experts
    m = math.ceil(count / per_token)
    needed = min(len(rounds(count, per_token)) * m + m - 1, ROUND_STEPS)
    shift, shifts = 0, 1
    forced = force_routers(model.clone(), shift_input=True)  # one prepared model runs every shift
    session = session_for(forced)
    while shift < shifts:
        if shift not in refs:  # the source forced alike, and its runs, kept for every stage of the branch
            refs[shift] = force_routers(lifted.clone(), shift), {}
        reference, memo = refs[shift]
        feed = static_feed(forced, reference, tokens, memo=memo)
        shifts = needed  # positions shift + [0, n): n = feed.positions
        inputs = {**feed.inputs, ROUTER_SHIFT: np.array(shift, np.int64)}
        a, n, ok = _judge(feed.ref_logits, session.infer(inputs)["logits"][0][feed.rows], feed.f16)
        if not ok:
            return _forced_reason(experts, a, n)
        shift += feed.positions
    return None


class _Unread:
    """What no probe can be trusted to read, as the source has it: the token embedding table
    and every weight (verify/weights.py); `changed` says what differs from it in a model (None:
    nothing; a source whose table is not found has only its weights compared)."""

    def __init__(self, source: ov.Model):
        self.table, self.weights, self.equal = source_table(source), weights_of(source), set()

    def changed(self, model: ov.Model) -> str | None:
        why = None if self.table is None else model_differs(self.table, model, self.equal)
        return why or weights_differ(self.weights, model, self.equal)


def _bisect_branch(report: BisectReport, branch: str, passes: list, lifted: ov.Model, tokens,
                   unread: _Unread, experts: tuple[int, int] | None = None) -> bool:
    """Judge each static stage of one branch; True when the branch ends wrong (the culprit is
    the first pass of the run of wrong stages at its end)."""
    model, models, stages, cases, memo = lifted.clone(), [lifted], [], {}, {}
    # A first chunk of dynamic rows (first-F) is judged on calls of 1 to F rows.
    bound = int(branch.split("-")[1]) if branch.startswith("first-") else None
    restorers = set()  # stages of mask-positions that rewrote their model (`_restorer`)
    forced_refs: dict = {}  # `_forced_static`'s forced sources by shift
    for i, p in enumerate(passes, start=1):
        result = PassManager([p], use_env=False).run(model)
        model = result.model
        if p.name == "mask-positions" and any(r.modified for r in result.records):
            restorers.add(i)
        models.append(model.clone())
        rows = bound if bound and dynamic_rows(model) else None
        if not (is_static(model) or rows):
            continue
        worst, failed, why_rows = None, None, None
        session = session_for(model)
        calls = static_cases(model, rows)
        for case in calls:  # each call the compile's probes make of such a model
            feed = static_feed(model, lifted, tokens, case, rows, memo)
            outputs = session.infer(feed.inputs)
            a, n, ok = _judge(feed.ref_logits, outputs["logits"][0][feed.rows], feed.f16)
            worst = (a, n) if worst is None else (max(worst[0], a), max(worst[1], n))
            if ok:
                cache = _wrong_rows(model, outputs, feed)
                if cache is not None:
                    ok, why_rows = False, cache
            if not ok:
                failed = case
                break
        why = why_rows or unread.changed(model)
        if experts and why is None:
            why = _forced_static(model, lifted, tokens, experts, forced_refs)
        cases[i] = (failed or calls[0], rows)
        probe = f"{failed[1]} token{'s' * (failed[1] > 1)} over {failed[0]} cached" if failed else ""
        stages.append((i, Stage(branch, i, p.spec(), *worst, failed is None and why is None, reason=why or "",
                                probe=probe)))
    report.stages.extend(s for _, s in stages)
    if not stages or stages[-1][1].ok:
        for _, s in stages:
            s.restored = not s.ok
        return False
    culprit = len(stages) - 1
    while culprit > 0 and not stages[culprit - 1][1].ok:
        culprit -= 1
    for _, s in stages[:culprit]:
        s.restored = not s.ok
    culprit = _restorer(stages, culprit, restorers)
    index, report.first_bad = stages[culprit]
    before, after = models[index - 1], models[index]
    case, rows = cases[index]
    if is_static(before) or (rows and dynamic_rows(before)):  # both run the step the culprit failed on
        report.first_tensor = first_diverging_tensor(
            before, after, lambda s: static_feed(s.interpreter.model, lifted, tokens, case, rows, memo).inputs)
    return True


def _restorer(stages: list, culprit: int, restorers: set) -> int:
    """The culprit among a branch's last run of wrong stages: its first, unless that is
    static-shape and a later one is mask-positions that rewrote its model. Static-shape makes
    slots stop being positions by design (a sliding window's distances go wrong), and
    mask-positions is there to give them back: when it rewrites the model and the outputs stay
    wrong, the fault is its own (a mask-positions that numbered the past from 1 was blamed on
    static-shape). A mask-positions that matched nothing leaves static-shape named."""
    first = stages[culprit][1]
    if not first.spec.startswith("static-shape"):
        return culprit
    return next((j for j in range(culprit + 1, len(stages)) if stages[j][0] in restorers), culprit)


def _wrong_rows(model: ov.Model, outputs: dict, feed) -> str | None:
    """Why the cache rows a static step wrote are not the source's for the same positions, or
    None: each present output's new rows (`written_rows`) against the lifted source's (an f16 or
    bf16 cache by F16_NRMSE). The logits alone missed a step that wrote layer 1's keys into its
    values' buffer and back: the next step reads them (tests/mutation: chunk_swap_present_kv_layer1)."""
    for name, got in written_rows(model, outputs, feed.positions).items():
        ref = feed.ref_rows.get(name)
        if ref is None or ref.shape != got.shape:
            continue
        port = next(o for o in model.outputs if name in o.get_names())
        a, n, ok = _judge(ref, got, port.get_element_type() in (ov.Type.f16, ov.Type.bf16))
        if not ok:
            return f"the cache rows it writes to {name} differ (max abs {a:.3g}, NRMSE {n:.3g})"
    return None


def first_diverging_tensor(before: ov.Model, after: ov.Model, feed_for) -> dict | None:
    """The first value (in `after`'s topological order) whose numbers differ from the
    same-named value of `before`, both run on the same logical input (`feed_for(session)`)."""
    sessions = session_for(before), session_for(after)
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
            differs = delta > f32_bound(r) or (r.size > 0 and nonfinite_mismatch(r, v) is not None)
        if differs:
            return {"tensor": name, "max_abs": delta, "shape": list(np.shape(value))}
    return None
