"""Pipelines as text, the pass registry, and the PassManager's instrumentation."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tempfile

import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.errors import UsageError
from kvc.passes import Instrumentation, PassFailure, PassManager, format_pipeline, parse_pipeline, registered
from tests.passes.models import kv_model

KV_IDS = ["past_key_values.0.keypresent.0.key", "past_key_values.0.valuepresent.0.value"]


def test_pipeline_text_round_trip():
    passes = parse_pipeline(" lift-state{beam=keep} , lift-state ")
    assert [p.name for p in passes] == ["lift-state", "lift-state"]
    assert passes[0].beam == "keep" and passes[1].beam == "drop"
    assert format_pipeline(passes) == "lift-state{beam=keep},lift-state"


@pytest.mark.parametrize("text,message", [
    ("no-such-pass", "unknown pass 'no-such-pass'"),
    ("lift-state{speed=9}", "has no option 'speed'"),
    ("lift-state{beam=sideways}", "must be one of drop, keep"),
    ("lift-state{beam}", "needs a value"),
    ("lift-state{beam=keep", "unbalanced"),
])
def test_bad_pipelines_are_usage_errors(text, message):
    with pytest.raises(UsageError, match=message):
        parse_pipeline(text)


def test_registry_lists_passes_with_kebab_names():
    assert "lift-state" in registered()


def _run(model, tmp_path=None, **kw):
    stream = io.StringIO()
    instr = Instrumentation(stream=stream, dump_dir=tmp_path, **kw)
    run = PassManager(parse_pipeline("lift-state,lift-state"), instr, use_env=False).run(model)
    return run, stream.getvalue()


def test_print_after_all_and_after_change(tmp_path):
    _, full = _run(kv_model(KV_IDS), print_after=("*",))
    assert full.count("// -----// IR Dump After lift-state //----- //") == 2
    _, changes = _run(kv_model(KV_IDS), print_after=("*",), after_change=True)
    assert changes.count("IR Dump After lift-state //") == 1
    assert changes.count("// -----// IR Dump After lift-state: unchanged //----- //") == 1


def test_print_before_glob_and_diff():
    _, out = _run(kv_model(KV_IDS), print_before=("lift-*",), print_after=("lift-state",), print_diff=True)
    assert out.count("IR Dump Before lift-state") == 2
    assert "IR Diff After lift-state" in out and "+input %past_key_values.0.key" in out


def test_dump_dir_layout_and_determinism(tmp_path):
    run, _ = _run(kv_model(KV_IDS), tmp_path / "a")
    _run(kv_model(KV_IDS), tmp_path / "b")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["000-input.txt", "001-lift-state.diff", "001-lift-state.txt", "002-lift-state.txt",
                     "index.json", "timings.json"]
    for name in files:
        if name != "timings.json":
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    index = json.loads((tmp_path / "a" / "index.json").read_text())
    assert [(r["pass"], r["changed"]) for r in index] == [("lift-state", True), ("lift-state", False)]
    assert index[0]["op_delta"]["Assign"] == -2 and index[0]["op_delta"]["ReadValue"] == -2
    assert (tmp_path / "a" / "002-lift-state.txt").read_text().count("\n") == 1  # one status line
    assert [r.modified for r in run.records] == [True, False] and all(r.seconds >= 0 for r in run.records)


def test_dumps_identical_across_processes(tmp_path):
    script = ("import sys; from kvc import fixtures; import kvc.ir as ir; from kvc.passes import *; "
              "PassManager(parse_pipeline('lift-state'), Instrumentation(dump_dir=sys.argv[1])).run("
              "ir.load(fixtures.path('llama')))")
    for d in ("p1", "p2"):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / d)], check=True,
                       env={**__import__("os").environ, "KVC_DUMP_DIR": ""})
    for name in ("000-input.txt", "001-lift-state.txt", "001-lift-state.diff", "index.json"):
        assert (tmp_path / "p1" / name).read_bytes() == (tmp_path / "p2" / name).read_bytes(), name


def test_local_rewrite_gives_local_diff(tmp_path):
    _run(ir.load(fixtures.path("llama")), tmp_path)
    diff = (tmp_path / "001-lift-state.diff").read_text()
    changed = [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    total = (tmp_path / "000-input.txt").read_text().count("\n")
    assert changed and len(changed) < 0.25 * total
    # The state machinery changes, and lines reading the renamed caches; the layers' compute does not.
    for op in ("MatMul", "Swish", "ReduceMean", "Power", "Sqrt", "Sin", "Cos", "ScaledDotProductAttention"):
        assert not any(f"= {op}<" in ln for ln in changed), op


def test_environment_mirror(tmp_path, monkeypatch):
    monkeypatch.setenv("KVC_PRINT_IR_AFTER", "lift-state")
    monkeypatch.setenv("KVC_PRINT_IR_AFTER_CHANGE", "1")
    monkeypatch.setenv("KVC_DUMP_DIR", str(tmp_path / "env"))
    stream = io.StringIO()
    PassManager(parse_pipeline("lift-state,lift-state"), Instrumentation(stream=stream)).run(kv_model(KV_IDS))
    assert stream.getvalue().count("unchanged") == 1
    assert (tmp_path / "env" / "index.json").exists()


def test_failure_context_and_dump(tmp_path):
    model = kv_model(KV_IDS[:1], assign_other_variable=True)
    pm = PassManager(parse_pipeline("lift-state{beam=keep}"), Instrumentation(dump_dir=tmp_path), use_env=False)
    with pytest.raises(PassFailure) as info:
        pm.run(model)
    text = str(info.value)
    assert "pass lift-state failed at Assign" in text and "passes run before it: none" in text
    dumped = tmp_path / "001-lift-state.failed-input.txt"
    assert f"IR before the failing pass: {dumped}" in text
    assert dumped.read_text() == ir.to_text(model)
    assert info.value.exit_code == 6


def test_failure_without_dump_dir_writes_nothing_and_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # read TMPDIR again
    try:
        with pytest.raises(PassFailure) as info:
            PassManager(parse_pipeline("lift-state"), use_env=False).run(
                kv_model(KV_IDS[:1], assign_other_variable=True))
    finally:
        tempfile.tempdir = None
    assert "run again with --dump-dir DIR (or KVC_DUMP_DIR=DIR)" in str(info.value)
    assert list(tmp_path.iterdir()) == []


# -- invariants, honesty, rules ---------------------------------------------------------------
from dataclasses import dataclass  # noqa: E402
from typing import ClassVar  # noqa: E402

from kvc.passes import Pass, PassResult  # noqa: E402


@dataclass(frozen=True)
class _Scale(Pass):
    """Multiplies the logits by 2 and claims `claim`."""

    name: ClassVar[str] = "test-scale"
    claim: bool = True

    def run(self, model):
        import numpy as np
        import openvino.opset13 as ops

        result = next(r for r in model.get_results() if "logits" in r.output(0).get_names())
        doubled = ops.multiply(result.input_value(0), ops.constant(np.float32(2)))
        result.input(0).replace_source_output(doubled.output(0))
        return PassResult(model, self.claim)


@dataclass(frozen=True)
class _Nothing(Pass):
    name: ClassVar[str] = "test-nothing"
    claim: bool = True

    def run(self, model):
        return PassResult(model, self.claim)


def test_check_mode_holds_modified_to_the_truth():
    def lifted():
        return PassManager(parse_pipeline("lift-state"), use_env=False).run(ir.load(fixtures.path("llama"))).model

    for p, said in ((_Scale(claim=False), "reported modified=False, but the model's text changed"),
                    (_Nothing(claim=True), "reported modified=True, but the model's text is unchanged")):
        with pytest.raises(PassFailure, match=f"pass {p.name} failed: check mode: it {said}"):
            PassManager([p], use_env=False, check=True).run(lifted())
        PassManager([p], use_env=False, check=False).run(lifted())  # outside check mode nobody looks
    honest = PassManager([_Scale(), _Nothing(claim=False)], use_env=False, check=True).run(lifted())
    assert [r.modified for r in honest.records] == [True, False]


def test_lift_state_on_a_stateless_model_reports_no_modification():
    lifted = PassManager(parse_pipeline("lift-state"), use_env=False).run(kv_model(KV_IDS)).model
    run = PassManager(parse_pipeline("lift-state"), use_env=False, check=True).run(lifted)
    assert run.records[0].modified is False


def test_static_shape_on_an_already_static_model_reports_no_modification():
    once = PassManager(parse_pipeline("lift-state,static-shape{size=96}"), use_env=False).run(
        ir.load(fixtures.path("llama"))).model
    again = PassManager(parse_pipeline("static-shape{size=96}"), use_env=False, check=True).run(once)
    assert again.records[0].modified is False


def test_requires_is_checked_and_names_the_pass():
    with pytest.raises(PassFailure, match=r"pass group-attention failed: requires static, which its input breaks: "
                                          r"output 0 of .* is still dynamic in dimension"):
        PassManager(parse_pipeline("lift-state,group-attention"), use_env=False).run(ir.load(fixtures.path("llama")))
    with pytest.raises(PassFailure, match=r"pass kv-io failed: requires stateless, which its input breaks: "
                                          r"the model is still stateful; run lift-state first"):
        PassManager(parse_pipeline("kv-io"), use_env=False).run(ir.load(fixtures.path("llama")))


def test_ensures_is_checked_and_names_the_pass():
    @dataclass(frozen=True)
    class FakeLift(Pass):
        name: ClassVar[str] = "test-fake-lift"
        ensures: ClassVar[tuple[str, ...]] = ("stateless",)

        def run(self, model):
            return PassResult(model, False)

    with pytest.raises(PassFailure, match=r"pass test-fake-lift failed: ensures stateless, which its output breaks"):
        PassManager([FakeLift()], use_env=False).run(kv_model(KV_IDS))


def test_every_pass_states_its_contract():
    from kvc.passes.framework.registry import declared
    from kvc.passes.static_shape import StaticShape

    contracts = {name: (declared(cls, "requires"), declared(cls, "ensures"))
                 for name, cls in registered().items() if not name.startswith("test-")}
    assert contracts["lift-state"] == ((), ("stateless",))
    assert contracts["static-shape"] == (("stateless",), ("static",))
    assert StaticShape(kind="prefill", rows="dynamic").ensures == ("static-but-rows",)
    assert contracts["lower-kvcache"][1] == ("standard-ops",)
    for name in ("mask-positions", "unmask-pad-rows", "group-attention"):
        assert "static" in contracts[name][0], name
    assert contracts["kv-io"] == (("stateless", "static-but-rows"), ("static-but-rows",))


def test_the_compile_pipeline_keeps_its_word_on_every_fixture(fixture_name):
    """Every pass of `kvc compile`'s pipeline, on every fixture, in check mode (with a chunked
    prefill and two generate variants): invariants hold, no stale type, honest `modified`."""
    from kvc.export.build import build_static
    from kvc.plan import StaticOptions

    static = build_static(ir.load(fixtures.path(fixture_name)),
                          StaticOptions(64, 32, prefill_chunk_size=16, variants=(80,)), use_env=False)
    assert set(static.models) == {"prefill", "generate-80", "generate-128"}


def test_rule_hits_are_counted_and_dumped(tmp_path):
    from kvc.export.build import branch_passes
    from kvc.plan import StaticOptions

    lifted = PassManager(parse_pipeline("lift-state"), use_env=False).run(ir.load(fixtures.path("mistral"))).model
    passes = branch_passes(StaticOptions(64, 64))["generate-128"]
    run = PassManager(passes, Instrumentation(dump_dir=tmp_path), use_env=False).run(lifted)
    hits = {r.name: r.rule_hits for r in run.records}
    layers = 2
    assert hits["group-attention"] == {"group-attention/sdpa": layers}
    assert hits["mask-positions"] == {"mask-positions/index-compare": 2}  # the window's and the causal comparison
    assert hits["unmask-pad-rows"] == {"unmask-pad-rows/float-mask": layers}  # mistral's masks are float
    misses = next(r.rule_misses for r in run.records if r.name == "unmask-pad-rows")
    assert [m[0] for m in misses] == ["unmask-pad-rows/bool-mask"] * layers  # and why the other rule missed
    assert all(m[2] == "the mask is f32, not boolean" for m in misses)
    index = json.loads((tmp_path / "index.json").read_text())
    assert {row["pass"]: row["rules"] for row in index} == hits


def test_debug_rules_prints_hits_and_misses(monkeypatch):
    stream = io.StringIO()
    lifted = PassManager(parse_pipeline("lift-state"), use_env=False).run(ir.load(fixtures.path("llama"))).model
    monkeypatch.setenv("KVC_DEBUG_RULES", "1")
    PassManager(parse_pipeline("fuse-kvcache"), Instrumentation(stream=stream)).run(lifted)
    out = stream.getvalue()
    assert "// rule fuse-kvcache/cache-update: 4 match(es)" in out
    assert re.search(r"// rule fuse-kvcache/cache-update did not match at Result '\w+' \(tensors logits\): "
                     r"Result '\w+' \(tensors logits\) does not store a two-input Concat", out)


def test_a_rule_without_rewrite_cannot_apply():
    from kvc.passes.framework.rules import Rule

    with pytest.raises(TypeError, match="has no rewrite"):
        Rule("x/y", ("Parameter",), match=lambda n: n).apply([])
