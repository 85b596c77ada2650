"""Every expert's wiring is run (kvc.verify.experts): the compile's probes again with each router
forced to the experts each position fixes, on the source and on the static IR. Before it, a
compiled model that computed expert 3 with expert 2's weights (every weight kept, byte for
byte) was published wherever no probe's router picked 2 or 3."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from kvc import fixtures
from kvc.errors import VerificationError
from kvc.export.manifest import MANIFEST
from kvc.ir.reader import load
from kvc.passes.framework.base import Pass, PassResult, option
from kvc.passes.framework.registry import register_pass
from kvc.runtime.session import NumpySession
from kvc.verify.compiled import Probe, probe_cases
from kvc.verify.experts import ROUTER_SHIFT, experts_of, force_routers, forced_cases, router_groups, rounds, routers
from tests.cli.runner import SMALL, kvc
from tests.export.test_weights_check import built, never_routed
from tests.mutation.mutants import apply, swap_experts

FORCED = "with every router forced to the experts each position fixes (4 experts, 2 a token)"


@pytest.mark.parametrize("name, experts, per_layer", [
    ("gpt_oss", (4, 2), 1), ("qwen3_moe", (4, 2), 1), ("granitemoe", (4, 2), 1), ("mixtral", (4, 2), 1),
    ("qwen2_moe", (8, 2), 1), ("phimoe", (4, 2), 2), ("qwen3_moe_int4_sym_g16", (4, 2), 1), ("llama", None, 0)])
def test_the_routers_are_the_topks_over_the_experts(name, experts, per_layer):
    """granitemoe's other two TopKs sort rows by expert (1-D, k from the data): not routers;
    qwen2_moe's shared expert is scaled by a sigmoid gate, which routes nothing; phimoe's
    sparsemixer picks a token's two experts with two top-1s, one group."""
    model = load(fixtures.path(name))
    assert len(routers(model)) == 2 * per_layer  # two layers
    assert [len(g) for g in router_groups(model)] == ([per_layer] * 2 if per_layer else [])
    assert experts_of(model) == experts


def sparsemixer(experts: int = 4) -> ov.Model:
    """Two top-1 picks a token, the second over the scores with the first's pick at -inf."""
    scores = ops.parameter([-1, experts], np.float32, name="scores")
    pos = ops.parameter([1, -1], np.int64, name="position_ids")
    first = ops.topk(scores, ops.constant(np.int64(1)), -1, "max", "none", "i64")
    masked = ops.scatter_elements_update(scores, ops.convert(first.output(1), "i32"),
                                         ops.broadcast(ops.constant(np.float32(-np.inf)),
                                                       ops.shape_of(first.output(1))), ops.constant(np.int64(-1)))
    second = ops.topk(masked, ops.constant(np.int64(1)), -1, "max", "none", "i64")
    for p in (scores, pos):
        p.output(0).set_names({p.get_friendly_name()})
    return ov.Model([ops.result(o) for o in (*first.outputs(), *second.outputs())], [scores, pos], "sparsemixer")


def test_a_router_that_picks_in_turns_is_forced_to_distinct_experts_with_finite_scores():
    model = sparsemixer()
    assert [len(g) for g in router_groups(model)] == [2]
    force_routers(model)
    scores = np.arange(12, dtype=np.float32).reshape(3, 4)
    compiled = ov.Core().compile_model(model, "CPU")
    out = compiled({"scores": scores, "position_ids": np.array([[0, 1, 2]], np.int64)})
    v1, i1, v2, i2 = (out[o] for o in compiled.outputs)
    table = rounds(4, 2)  # rounds of two positions: 0 and 1 in the first, 2 in the second
    np.testing.assert_array_equal(np.hstack([i1, i2]), [table[0][:2], table[0][2:], table[1][:2]])
    np.testing.assert_array_equal(np.hstack([v1, v2]), np.take_along_axis(scores, np.hstack([i1, i2]), 1))


def router(experts: int, k: int, positions: bool = True) -> ov.Model:
    scores = ops.parameter([-1, experts], np.float32, name="scores")
    pos = ops.parameter([1, -1], np.int64, name="position_ids")
    topk = ops.topk(scores, ops.constant(np.int64(k)), -1, "max", "value", "i32")
    params = [scores, pos] if positions else [scores]
    for p in params:
        p.output(0).set_names({p.get_friendly_name()})
    return ov.Model([ops.result(topk.output(0)), ops.result(topk.output(1))], params, "router")


@pytest.mark.parametrize("engine", ["openvino", "numpy"])
def test_a_forced_router_picks_the_experts_each_position_fixes(engine):
    model = force_routers(router(5, 2))
    scores = np.arange(25, dtype=np.float32).reshape(5, 5) * -1.0  # the router would pick 0 and 1 everywhere
    feed = {"scores": scores, "position_ids": np.array([[7, 8, 9, 10, 11]], np.int64)}
    if engine == "numpy":
        values, indices = (NumpySession(model).infer(feed)[o.get_any_name()] for o in model.outputs)
    else:
        compiled = ov.Core().compile_model(model, "CPU")
        out = compiled(feed)
        values, indices = (out[o] for o in compiled.outputs)
    table = rounds(5, 2)  # E odd: the identity, then seeded permutations; a round is ceil(5 / 2) = 3 positions
    expected = np.array([[table[(p // 3) % len(table)][(p * 2 + j) % 5] for j in range(2)] for p in range(7, 12)])
    np.testing.assert_array_equal(indices, expected)
    assert indices.dtype == np.int32
    np.testing.assert_array_equal(values, np.take_along_axis(scores, expected, 1))


def test_a_shift_fed_as_an_input_forces_what_the_same_shift_built_in_forces():
    """kvc bisect prepares one forced model per stage and feeds it every shift (ROUTER_SHIFT)."""
    scores = np.arange(25, dtype=np.float32).reshape(5, 5) * -1.0
    feed = {"scores": scores, "position_ids": np.array([[7, 8, 9, 10, 11]], np.int64)}
    model = force_routers(router(5, 2), shift_input=True)
    fed = NumpySession(model)

    def indices(session, m, extra=None):
        return session.infer({**feed, **(extra or {})})[m.outputs[1].get_any_name()]

    for shift in (0, 1, 4, 13):
        built = force_routers(router(5, 2), shift)
        np.testing.assert_array_equal(indices(fed, model, {ROUTER_SHIFT: np.array(shift, np.int64)}),
                                      indices(NumpySession(built), built))
    assert not np.array_equal(*(indices(fed, model, {ROUTER_SHIFT: np.array(s, np.int64)}) for s in (0, 1)))


def test_a_model_with_routers_but_no_positions_is_refused():
    with pytest.raises(VerificationError, match="cannot run every expert of model 'router': it routes experts but "
                                                "has no position_ids input"):
        force_routers(router(4, 2, positions=False))


def test_the_forced_probes_decode_each_variant_over_enough_positions_to_pick_every_expert():
    plan = built("gpt_oss").plan.lengths
    cases = probe_cases(plan, 300)
    far = [p for p in cases if p.decode]
    # the variant's last two steps, over empty rows and over a far past
    assert far == [Probe(far[0].prompt, 2, 128, 126, True), Probe(far[0].prompt, 2, 128, 126, True, True)]
    # 4 experts, 2 a token: a round of two positions, three consecutive ones hold a whole round
    assert [(len(p.prompt), p.origin) for p in forced_cases(cases, 4, 2) if p.decode] == [(2, 125), (2, 125)]
    forced = forced_cases(cases, 128, 8)  # Qwen3-MoE's: rounds of 16 positions, 31 consecutive hold one
    assert [p for p in forced if not p.decode] == [p for p in cases if not p.decode]
    longs = [p for p in forced if p.decode]
    assert [(len(p.prompt), p.new_tokens, p.start, p.origin, p.filled) for p in longs] == [
        (30, 2, 128, 97, False), (30, 2, 128, 97, True)]


def test_the_rounds_put_every_pair_of_experts_together_in_either_slot():
    """Forced by position alone, a token's experts were always the same pairs ({0, 1}, {2, 3}
    of 4): a graph keyed on a pair no router picked passed (moe_pair_weight_moved)."""
    for experts in (4, 8, 64):
        table = rounds(experts, 2)
        assert all(sorted(row) == list(range(experts)) for row in table)  # each round picks every expert
        pairs = {(row[2 * q], row[2 * q + 1]) for row in table for q in range(experts // 2)}
        assert len(pairs) == experts * (experts - 1)  # every ordered pair
    assert all(sorted(row) == list(range(128)) for row in rounds(128, 8))


@pytest.mark.parametrize("mutant, model", [("gen_experts_2_3_swapped", "generate-128"),
                                           ("prefill_experts_2_3_swapped", "prefill")])
def test_experts_no_probe_routes_to_swapped_are_refused_only_by_the_forced_check(tmp_path, monkeypatch, mutant,
                                                                                   model):
    """Experts 2 and 3 never picked (their router bias -1e4) and computed with each other's down
    projection: every weight is the source's and every probe agrees; the forced check refuses."""
    import kvc.export.compile as compile_

    source = never_routed(tmp_path, (2, 3))
    applied = apply(mutant, monkeypatch.setattr, monkeypatch.setenv, "ir")
    result = kvc("compile", source, "-o", tmp_path / "out", *SMALL, code=4)
    assert applied.edits[model] == 2  # both layers
    assert f"does not reproduce {source}: {FORCED}, prompt of " in result.output
    assert not (tmp_path / "out").exists()
    with monkeypatch.context() as m:
        m.setattr(compile_, "_verify_experts", lambda *args: None)
        published = kvc("compile", source, "-o", tmp_path / "blind", *SMALL)
    assert "blobs: CPU" in published.output and (tmp_path / "blind" / MANIFEST).exists()


@pytest.mark.parametrize("name", ["qwen3_moe", "phimoe", "qwen3_moe_int4_sym_g16"])
def test_a_clean_compile_records_and_says_the_forced_check(tmp_path, name):
    """phimoe's two top-1 routers forced apart (not as one group) took the same expert, and the
    forced check refused the clean compile (exit 4)."""
    result = kvc("compile", fixtures.path(name), "-o", tmp_path / "out", *SMALL)
    experts = json.loads((tmp_path / "out" / MANIFEST).read_text())["verification"]["experts"]
    assert experts["ok"] and (experts["experts"], experts["per_token"]) == (4, 2)
    assert len(experts["results"]) >= 4 and all(r["ok"] for r in experts["results"])
    assert ("verification: experts: every router forced to the experts each position fixes (4 experts, 2 a "
            f"token): {len(experts['results'])} probes agree with the source forced alike") in result.output


def test_a_dense_model_has_no_forced_check(tmp_path):
    kvc("compile", fixtures.path("llama"), "-o", tmp_path / "out", *SMALL)
    assert "experts" not in json.loads((tmp_path / "out" / MANIFEST).read_text())["verification"]


def test_kvc_verify_runs_the_forced_check(tmp_path, monkeypatch):
    """A directory compiled with --no-verify from the swapped mutant: every probe of `kvc verify`
    agrees (no router picks 2 or 3), the forced check does not."""
    source, out = never_routed(tmp_path, (2, 3)), tmp_path / "out"
    apply("gen_experts_2_3_swapped", monkeypatch.setattr, monkeypatch.setenv, "ir")
    kvc("compile", source, "-o", out, *SMALL, "--no-verify")
    args = ("verify", out, "--backends", "numpy", "--max-new-tokens", "2")
    result = kvc(*args, code=4)
    assert f"kvc: error: mismatch in the experts: {FORCED}, prompt of " in result.output
    report = json.loads(kvc(*args, "--json", code=4).stdout.split("\nkvc: error")[0])
    assert all(r["ok"] for r in report["results"]) and report["weights"]["ok"]
    assert not report["experts"]["ok"] and not report["ok"]
    clean = tmp_path / "clean"
    monkeypatch.undo()
    kvc("compile", source, "-o", clean, *SMALL)
    assert "experts: every router forced" in kvc("verify", clean, "--backends", "numpy", "--max-new-tokens",
                                                "2").output
    # without the numpy backend the check is not run, and the output says so (it said nothing)
    bare = kvc("verify", out, "--backends", "openvino", "--max-new-tokens", "2").output
    assert "experts: not checked: every expert's wiring is proved on the numpy backend" in bare


@register_pass
@dataclass(frozen=True)
class SwapExperts(Pass):
    """Test only: experts a and b computed with each other's down projection (`swap_experts`)."""

    name: ClassVar[str] = "test-swap-experts"
    a: int = option(2, help="one expert")
    b: int = option(3, help="the other")

    def run(self, model):
        return PassResult(model, swap_experts(model, self.a, self.b) > 0)


def test_bisect_names_the_pass_that_swaps_experts_no_probe_routes_to(tmp_path, monkeypatch):
    """A pass that miswires experts 2 and 3, which gpt_oss's routers never pick here: bisect
    names it, in the common passes and in a static branch, by the forced routers."""
    import kvc.export.build as build

    source = never_routed(tmp_path, (2, 3))
    common = json.loads(kvc("bisect", source, *SMALL, "--passes", "lift-state,test-swap-experts", "--json",
                            code=4).stdout)
    bad = common["first_bad_pass"]
    assert (bad["spec"], bad["branch"]) == ("test-swap-experts", "common")
    assert bad["reason"].startswith(FORCED + ", the logits differ (max abs ")
    assert bad["max_abs"] < 1e-4  # the probe's own routing never reads experts 2 and 3
    real = build.branch_passes

    def with_swap(options):
        branches = real(options)
        branches["generate-128"].insert(2, SwapExperts())  # after mask-positions (gpt_oss has a window)
        return branches

    monkeypatch.setattr(build, "branch_passes", with_swap)
    data = json.loads(kvc("bisect", source, *SMALL, "--json", code=4).stdout)
    bad = data["first_bad_pass"]
    assert (bad["spec"], bad["branch"], bad["index"]) == ("test-swap-experts", "generate-128", 3)
    assert bad["reason"].startswith(FORCED + ", the logits differ (max abs ")
    monkeypatch.undo()
    clean = json.loads(kvc("bisect", source, *SMALL, "--json").stdout)
    assert clean["ok"]


def test_bisect_runs_a_one_row_step_at_every_shift_of_the_forced_experts(tmp_path, monkeypatch):
    """Experts 0 and 1 never picked and swapped, in the generate branch: its one-row step at
    position 63 is forced to experts 2 and 3; only the step shifted by one position (experts 0
    and 1) runs the fault."""
    import kvc.export.build as build

    source = never_routed(tmp_path, (0, 1))
    real = build.branch_passes
    monkeypatch.setattr(build, "branch_passes", lambda options: {
        **real(options), "generate-128": [*real(options)["generate-128"], SwapExperts(a=0, b=1)]})
    bad = json.loads(kvc("bisect", source, *SMALL, "--json", code=4).stdout)["first_bad_pass"]
    assert (bad["spec"], bad["branch"]) == ("test-swap-experts{a=0,b=1}", "generate-128")
    assert bad["reason"].startswith(FORCED + ", the logits differ")
