"""Pipelines as text, the pass registry, and the PassManager's instrumentation."""

from __future__ import annotations

import io
import json
import subprocess
import sys

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
    assert [r.changed for r in run.records] == [True, False] and all(r.seconds >= 0 for r in run.records)


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


def test_failure_without_dump_dir_writes_a_temp_file():
    with pytest.raises(PassFailure) as info:
        PassManager(parse_pipeline("lift-state"), use_env=False).run(kv_model(KV_IDS[:1], assign_other_variable=True))
    path = str(info.value).rsplit("IR before the failing pass: ", 1)[1].strip()
    assert open(path).read().startswith("# kvc ir text v1")
