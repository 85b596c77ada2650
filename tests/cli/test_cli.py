"""The kvc command line: every command, its JSON, and its error paths and exit codes."""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
from click.testing import CliRunner

from kvc import fixtures
from kvc.cli.main import cli
from kvc.ir.reader import core
from kvc.passes.framework.base import Pass, PassResult
from kvc.passes.framework.registry import register_pass
from tests.cli.runner import SMALL, kvc



@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "out"
    kvc("compile", fixtures.path("llama"), "-o", out, *SMALL, "--prefill-chunk-size", "32", "--prefill-first", "0",
        "--kv-precision", "f16", "--device", "CPU", "--dumps")
    return out


def test_compile_summary_and_outputs(compiled):
    assert (compiled / "manifest.json").exists() and (compiled / "dumps" / "prefill" / "index.json").exists()
    text = kvc("inspect", compiled).output
    assert "lengths: prompt P=64, response R=64, chunk=32, capacity=128" in text
    assert "generate-128  1x1        1x128           1x2x127x16" in text


@pytest.mark.parametrize("args, chunk", [((), "host"), (("--inference-precision", "f32"), 32),
                                         (("--inference-precision", "bf16"), 16), (("--device", "NPU"), 0),
                                         (("--device", "CPU", "--device", "NPU"), 0),
                                         (("--prefill-chunk-size", "0"), 0), (("--prefill-chunk-size", "64"), 64)])
def test_prefill_chunk_auto_follows_the_device(tmp_path, args, chunk):
    """auto: the CPU's measured chunks for the blobs' arithmetic (32 and a bulk 256 at f32; 16
    and a bulk 128 at bf16; by default the host's own precision) and, when compiling for CPU
    only, a first chunk of dynamic rows, the largest chunk's, at f32 and first chunks of 16 and
    128 at bf16; else the whole prompt at once, as NPUW does by default; an explicit size
    always wins. Bulk and static first chunks not below P are dropped (with a note), a dynamic
    one lowered to P - C: at P 128 the first chunk of 16 (bf16) or of 1..96 (f32), at P 1024
    none dropped."""
    host = core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    precision = args[args.index("--inference-precision") + 1] if "--inference-precision" in args else host
    if chunk == "host":
        chunk = 16 if host in ("bf16", "f16") else 32
    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "out", "--max-prompt-len", "128",
                 "--min-response-len", "64", "--no-verify", "--json", *args)
    lengths = json.loads(result.stdout)["plan"]["lengths"]
    assert lengths["prefill_chunk_size"] == chunk and lengths["prefill_bulk_chunks"] == []
    auto = "--prefill-chunk-size" not in args and "NPU" not in args
    dropped = "128" if chunk == 16 else "256"
    assert any(f"prefill bulk chunk {dropped} dropped" in a for a in lengths["adjustments"]) == auto
    first_auto = "NPU" not in args and chunk != 0  # with a chunked prefill
    dynamic = first_auto and precision == "f32"
    assert lengths.get("prefill_first_rows", "static") == ("dynamic" if dynamic else "static")
    if dynamic:  # the largest chunk's rows: 256 lowered to P - C, or the 64 asked
        assert lengths["prefill_first_chunks"] == ([96] if auto else [chunk])
        assert any("first prefill chunk 256 lowered to 96" in a for a in lengths["adjustments"]) == auto
    else:
        assert any("first prefill chunk 128 dropped" in a for a in lengths["adjustments"]) == first_auto
        assert lengths["prefill_first_chunks"] == ([16] if first_auto else [])
    if auto and not args:
        result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "long", "--max-prompt-len", "1024",
                     "--min-response-len", "64", "--no-verify", "--json")
        lengths = json.loads(result.stdout)["plan"]["lengths"]
        assert lengths["prefill_bulk_chunks"] == ([128] if chunk == 16 else [256])
        assert lengths["prefill_first_chunks"] == ([256] if dynamic else [16, 128])


@pytest.mark.parametrize("args, kv, attention", [
    ((), "host", "fold"), (("--inference-precision", "f32"), "f32", "fold"),
    (("--inference-precision", "bf16"), "bf16", "fold"), (("--device", "NPU"), "f16", "grouped"),
    (("--device", "CPU", "--device", "NPU"), "f16", "grouped"),
    (("--kv-precision", "f32", "--attention", "sdpa"), "f32", "sdpa")])
def test_kv_precision_and_attention_auto_follow_the_device(tmp_path, args, kv, attention):
    """auto: when compiling for CPU only, a cache of the blobs' own arithmetic (by default the
    host's: bf16 or f32), else f16; for CPU only the generate models read the past apart from the new rows
    (group-attention{split_past=true}) and the prefill models fold the GQA repeat into their
    query rows ({fold=true}); the NPU keeps the grouped Concat; the prefill models' MLPs over
    rows (mlp-rows) for CPU only at bf16. Explicit values always win."""
    if kv == "host":
        kv = core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    out = tmp_path / "out"
    kvc("compile", fixtures.path("llama"), "-o", out, "--max-prompt-len", "128", "--min-response-len", "64",
        "--no-verify", *args)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["plan"]["options"]["kv_precision"], manifest["plan"]["options"]["attention"]) == (kv, attention)
    pipelines = {name: m["pipeline"] for name, m in manifest["models"].items()}
    assert all(("split_past=true" in text) == (attention == "fold" and name.startswith("generate-"))
               for name, text in pipelines.items())
    dynamic = manifest["plan"]["lengths"].get("prefill_first_rows") == "dynamic"  # its attention is the model's
    assert all(("fold=true" in text) == (attention == "fold" and (name.startswith("prefill") or
                                                                  name.startswith("first") and not dynamic))
               for name, text in pipelines.items())
    host = core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    precision = args[args.index("--inference-precision") + 1] if "--inference-precision" in args else host
    rows = "NPU" not in args and precision == "bf16"
    assert manifest["plan"]["options"]["prefill_mlp"] == ("rows" if rows else "as-is")
    assert all(("mlp-rows" in text) == (rows and name.startswith(("prefill", "first")))
               for name, text in pipelines.items())


def test_bulk_prefill_chunks_compile_verify_and_run(tmp_path):
    """--prefill-chunk-size 16,32: a prefill model per size, verified (a probe of 32 + 9 tokens
    runs the bulk model over a chunk's rows), listed, and run with the golden tokens."""
    out = tmp_path / "o"
    text = kvc("compile", fixtures.path("llama"), "-o", out, *SMALL, "--prefill-chunk-size", "16,32").output
    assert "chunk=16 + bulk 32" in text and "verification: prompt of 41 tokens" in text
    assert re.search(r"^prefill-32 +1x32 +1x64 +1x2x32x16 ", text, re.M), text
    golden = fixtures.goldens("llama")["prompts"][2]  # 54 tokens: a chunk, then bulk calls
    data = json.loads(kvc("run", out, "--prompt-ids", ",".join(map(str, golden["ids"])), "--max-new-tokens", "8",
                          "--json").stdout)
    assert data["tokens"] == golden["tokens"]["openvino"][:8]


@pytest.mark.parametrize("value, says", [("16,48", "power of two, got 16,48"), ("16,x", "sizes like 64,512"),
                                         ("0,64", "0 (the whole prompt at once) cannot be combined")])
def test_bad_prefill_chunk_sizes_are_usage_errors(tmp_path, value, says):
    assert says in kvc("compile", "-o", tmp_path / "x", *SMALL, "--prefill-chunk-size", value, code=2).output


def test_repeated_prefill_chunk_sizes_count_once():
    """"0,0" is the whole prompt at once (it blamed first chunks of size 0), "32,32,256" one
    chunk and one bulk chunk; the auto first chunks follow the chunks as resolved."""
    from kvc.cli.options import _chunk_value
    from kvc.export.compile import resolve_first, resolve_first_rows

    assert _chunk_value(None, None, "0,0") == 0 and _chunk_value(None, None, "256,32,32") == (32, 256)
    assert resolve_first("auto", ("CPU",), (0, 0), "dynamic") == ()
    assert resolve_first_rows("auto", ("CPU",), "f32", (0, 0)) == "static"


def test_compile_json_is_the_manifest(tmp_path):
    out = kvc("compile", fixtures.path("qwen2"), "-o", tmp_path / "o", *SMALL, "--no-verify", "--json").stdout
    manifest = json.loads(out)
    assert manifest == json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["verification"] is None


def test_compile_reports_alignment(tmp_path):
    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "o", "--max-prompt-len", "50",
                 "--min-response-len", "60", "--no-verify")
    assert "note: max prompt length 50 aligned up to 64 (multiple of 64)" in result.output
    assert "adjusted: min response length 60 aligned up to 64" in result.output


def test_compile_default_model_is_the_bundled_one(tmp_path):
    result = kvc("compile", "-o", tmp_path / "o", *SMALL, "--no-verify")
    assert "compiled the bundled model (llama)" in result.output
    data = json.loads(kvc("compile", "-o", tmp_path / "j", *SMALL, "--no-verify", "--json").stdout)
    assert data["source"]["path"] == str(fixtures.bundled_model().absolute())


def test_compile_prints_ir_after_change(tmp_path):
    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "o", *SMALL, "--no-verify",
                 "--print-ir-after", "lower-kvcache", "--print-ir-after-change")
    models = json.loads((tmp_path / "o" / "manifest.json").read_text())["models"]
    assert {"prefill", "generate-128"} <= set(models)  # and first-16 where the CPU computes at bf16
    assert result.output.count("IR Dump After lower-kvcache: unchanged") == len(models)


def test_compile_errors(tmp_path, compiled):
    assert "exists; pass --force" in kvc("compile", "-o", compiled, *SMALL, code=2).output
    assert "power of two" in kvc("compile", "-o", tmp_path / "x", "--prefill-chunk-size", "48", code=2).output
    assert "unknown pass 'bogus'" in kvc("compile", "-o", tmp_path / "x", "--passes", "bogus", code=2).output
    bad = tmp_path / "bad.xml"
    bad.write_text("<net")
    assert "not well-formed XML" in kvc("compile", bad, "-o", tmp_path / "x", code=3).output
    # A beam has no place in the batch-1 static contract: refused before any pass runs.
    for beam in ("keep", "indirect"):
        result = kvc("compile", "-o", tmp_path / "x", *SMALL, "--beam", beam, code=2)
        assert f"beam={beam} cannot be compiled" in result.output and "batch 1" in result.output
        assert "running passes" not in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x").exists()


def test_run_ids_and_json(compiled):
    golden = fixtures.goldens("llama")["prompts"][0]
    ids = ",".join(map(str, golden["ids"]))
    data = json.loads(kvc("run", compiled, "--prompt-ids", ids, "--max-new-tokens", "24", "--json",
                          "--backend", "numpy").stdout)
    assert data["tokens"] == golden["tokens"]["openvino"]
    m = data["metrics"]  # genai's PerfMetrics, in ms
    assert m["new_tokens"] == 24 and m["variants"] == data["variants"] and data["variants"]
    assert m["load_ms"] > 0 and m["ttft_ms"] > 0
    assert 0 < m["tpot_ms"]["p50"] <= m["tpot_ms"]["p90"]
    assert m["throughput_tokens_per_s"] == pytest.approx(1e3 / m["tpot_ms"]["mean"])
    assert m["generate_ms"] == pytest.approx(m["ttft_ms"] + 23 * m["tpot_ms"]["mean"])
    text = kvc("run", compiled, "--prompt-ids", ids, "--max-new-tokens", "24").output
    assert "generated (24 tokens)" in text
    assert re.search(r"^openvino: load \d+ ms · TTFT [\d.]+ ms · TPOT [\d.]+ ms \(p50 [\d.]+, p90 [\d.]+\) · "
                     r"[\d.]+ tokens/s · variants \d+", text, re.M), text


def test_run_text_prompt(compiled):
    golden = fixtures.goldens("llama")["prompts"][1]
    data = json.loads(kvc("run", compiled, "--prompt", golden["text"], "--max-new-tokens", "24", "--json").stdout)
    assert data["prompt"] == golden["ids"] and data["tokens"] == golden["tokens"]["openvino"]
    assert isinstance(data["text"], str)


def test_run_errors(compiled, tmp_path):
    assert "exactly one of --prompt-ids and --prompt" in kvc("run", compiled, code=2).output
    assert "token ids" in kvc("run", compiled, "--prompt-ids", "a,b", code=2).output
    long = ",".join(["5"] * 65)
    assert "prompt of 65 tokens does not fit" in kvc("run", compiled, "--prompt-ids", long, code=2).output
    assert "at most 127 tokens can follow" in kvc("run", compiled, "--prompt-ids", "1,2",
                                                  "--max-new-tokens", "200", code=2).output
    assert "not a kvc compiled directory" in kvc("run", tmp_path, "--prompt-ids", "1", code=3).output


def test_run_compile_from_compiles_once_then_runs_what_it_compiled(tmp_path):
    """`kvc run OUT --compile-from MODEL`: OUT absent, MODEL is compiled into it (kvc compile's
    defaults, verified) and served in the same process; OUT a compile of MODEL's files, it is
    run as it is; OUT a compile of other files, it is refused and left alone unless --force."""
    golden = fixtures.goldens("llama")["prompts"][0]
    ids = ",".join(map(str, golden["ids"]))
    out = tmp_path / "out"
    first = kvc("run", out, "--compile-from", fixtures.path("llama"), "--prompt-ids", ids, "--max-new-tokens", "24",
                "--json")
    data = json.loads(first.stdout)
    assert data["compiled"] and data["tokens"] == golden["tokens"]["openvino"]
    assert "verifying the static pipeline" in first.stderr and (out / "manifest.json").is_file()
    manifest = (out / "manifest.json").read_bytes()
    again = kvc("run", out, "--compile-from", fixtures.path("llama"), "--prompt-ids", ids, "--max-new-tokens", "24",
                "--json")
    assert not json.loads(again.stdout)["compiled"] and json.loads(again.stdout)["tokens"] == data["tokens"]
    assert f"{out}'s manifest records {fixtures.path('llama')} as its source, unchanged: running it" in again.stderr
    assert "--check hashes them" in again.stderr and "verifying" not in again.stderr
    other = kvc("run", out, "--compile-from", fixtures.path("qwen2"), "--prompt-ids", "1,2", code=2)
    assert "holds a compile of other files" in other.output and "--force" in other.output
    assert (out / "manifest.json").read_bytes() == manifest
    npu = kvc("run", out, "--compile-from", fixtures.path("llama"), "--backend", "npu", "--prompt-ids", "1,2", code=2)
    assert "for CPU, not NPU" in npu.output and (out / "manifest.json").read_bytes() == manifest
    forced = kvc("run", out, "--compile-from", fixtures.path("qwen2"), "--force", "--prompt-ids", "1,2", "--json")
    assert json.loads(forced.stdout)["compiled"] and (out / "manifest.json").read_bytes() != manifest
    assert "--force goes with --compile-from" in kvc("run", out, "--force", "--prompt-ids", "1", code=2).output
    assert "does not exist" in kvc("run", tmp_path / "missing", "--prompt-ids", "1", code=2).output


def test_run_compile_from_refuses_a_compile_made_without_verification(tmp_path):
    """Red team A (4): OUT compiled from MODEL with --no-verify (a faulty one generated other
    tokens) was served by `--compile-from MODEL`, which promises kvc compile's defaults,
    verification on, as a verified compile, with exit 0. It is refused and left alone, like a
    compile for another device; --force compiles it again, verified."""
    out = tmp_path / "out"
    kvc("compile", fixtures.path("llama"), "-o", out, *SMALL, "--device", "CPU", "--no-verify")
    manifest = (out / "manifest.json").read_bytes()
    refused = kvc("run", out, "--compile-from", fixtures.path("llama"), "--prompt-ids", "1,2", code=2)
    assert (f"{out} is a compile of {fixtures.path('llama')} without a verification (kvc compile --no-verify)"
            in refused.output) and "pass --force" in refused.output
    assert (out / "manifest.json").read_bytes() == manifest and "generated" not in refused.output
    assert "generated (2 tokens)" in kvc("run", out, "--prompt-ids", "1,2", "--max-new-tokens", "2").output
    forced = kvc("run", out, "--compile-from", fixtures.path("llama"), "--force", "--prompt-ids", "1,2", "--json")
    assert json.loads(forced.stdout)["compiled"] and "verifying the static pipeline" in forced.stderr
    assert json.loads((out / "manifest.json").read_text())["verification"]["ok"]
    kvc("run", out, "--compile-from", fixtures.path("llama"), "--prompt-ids", "1,2")  # verified: served


def test_run_compile_from_refuses_a_compile_another_kvc_verified(tmp_path):
    """kvc's version does not move between changes, and `--compile-from` served a directory an
    older kvc had compiled and verified, with the checks it had then. The manifest records
    `kvc_build` (a digest of kvc's code); another build's compile is refused and left alone,
    --force compiles it again."""
    out = tmp_path / "out"
    kvc("compile", fixtures.path("llama"), "-o", out, *SMALL, "--device", "CPU")
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "kvc_build": "0123456789abcdef"}))
    refused = kvc("run", out, "--compile-from", fixtures.path("llama"), "--prompt-ids", "1,2", code=2)
    assert "that another kvc verified (its build 0123456789abcdef" in refused.output and "--force" in refused.output
    assert json.loads(path.read_text())["kvc_build"] == "0123456789abcdef"  # left alone
    forced = kvc("run", out, "--compile-from", fixtures.path("llama"), "--force", "--prompt-ids", "1,2", "--json")
    assert json.loads(forced.stdout)["compiled"]
    assert json.loads(path.read_text())["kvc_build"] == manifest["kvc_build"]
    kvc("run", out, "--compile-from", fixtures.path("llama"), "--prompt-ids", "1,2")  # this build's: served


def test_run_compile_from_for_the_numpy_backend_runs_the_ir(tmp_path):
    golden = fixtures.goldens("llama")["prompts"][0]
    data = json.loads(kvc("run", tmp_path / "out", "--compile-from", fixtures.path("llama"), "--backend", "numpy",
                          "--prompt-ids", ",".join(map(str, golden["ids"])), "--max-new-tokens", "24", "--json").stdout)
    assert data["compiled"] and data["tokens"] == golden["tokens"]["openvino"]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["devices"] == ["CPU"]
    npu = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "npu", *SMALL, "--device", "NPU")
    again = kvc("run", tmp_path / "npu", "--compile-from", fixtures.path("llama"), "--backend", "numpy",
                "--prompt-ids", "1,2", "--json")  # the IR of a compile for any device serves numpy
    assert not json.loads(again.stdout)["compiled"] and npu.exit_code == 0


def test_verify_table_and_json(compiled):
    result = kvc("verify", compiled, "--backends", "numpy,openvino", "--max-new-tokens", "6")
    assert "verification: OK" in result.output and "backend" in result.output
    data = json.loads(kvc("verify", compiled, "--backends", "numpy", "--max-new-tokens", "4", "--json").stdout)
    assert data["ok"] and [r["prompt_tokens"] for r in data["results"][:3]] == [1, 32, 64]
    # then the compile's probes, whose far ones start where no prompt from position 0 reaches
    far = [r for r in data["results"] if r.get("from_position")]
    last_fed = max(r["from_position"] + r["prompt_tokens"] + r["new_tokens"] - 2 for r in far)
    assert last_fed == 127  # the capacity's last position (P 64 + R 64)
    assert "from 126" in result.output


def test_verify_holds_one_engine_at_a_time(compiled, monkeypatch):
    """The source's runs, the peer's and each backend's pipeline each come and go before the next
    is opened: kvc verify held the f32 source, the peer, the numpy pipeline and the blobs at
    once (6.2 GB on the 250M bench model)."""
    import gc
    import weakref

    from kvc.export import load
    from kvc.runtime import session

    alive, opened = weakref.WeakSet(), []
    for cls in (session.OpenVINOSession, session.NumpySession):
        def tracked(self, *args, _init=cls.__init__, **kw):
            _init(self, *args, **kw)
            alive.add(self)
        monkeypatch.setattr(cls, "__init__", tracked)
    real = load.pipeline_from

    def pipeline_from(*args, **kw):
        gc.collect()
        opened.append(sorted(type(s).__name__ for s in alive))
        return real(*args, **kw)
    monkeypatch.setattr(load, "pipeline_from", pipeline_from)
    kvc("verify", compiled, "--backends", "numpy,openvino", "--max-new-tokens", "2")
    assert opened == [[], []]


def test_verify_against_another_model_fails_with_exit_4(compiled):
    result = kvc("verify", compiled, "--against", fixtures.path("qwen2"), "--backends", "numpy", code=4)
    assert "verification: MISMATCH" in result.output and "kvc: error: mismatch" in result.output


def test_verify_prompts_file(compiled, tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([[1, 2, 3], {"ids": [4, 5]}]))
    data = json.loads(kvc("verify", compiled, "--prompts", f, "--backends", "numpy", "--json").stdout)
    assert [r["prompt_tokens"] for r in data["results"][:2]] == [3, 2]
    assert all(r["prompt"] == i for i, r in enumerate(data["results"]))  # the compile's probes follow
    f.write_text('{"nope": 1}')
    assert "expected a JSON list" in kvc("verify", compiled, "--prompts", f, code=2).output


def test_goldens_record_and_check(compiled, tmp_path):
    goldens = tmp_path / "goldens.json"
    kvc("verify", compiled, "--record", goldens, "--backends", "numpy", "--max-new-tokens", "8")
    assert "matches" in kvc("verify", compiled, "--goldens", goldens, "--backends", "openvino").output
    data = json.loads(goldens.read_text())
    data["prompts"][0]["tokens"][3] += 1
    goldens.write_text(json.dumps(data))
    result = kvc("verify", compiled, "--goldens", goldens, "--backends", "numpy", code=4)
    assert "token 3 changed" in result.output


def test_an_output_path_that_cannot_be_written_is_exit_7(compiled, tmp_path):
    """A file standing where a directory must be (root passes permission checks): the goldens,
    the pass dumps and a plan's costs were internal errors (exit 1)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = kvc("verify", compiled, "--record", blocker / "g.json", "--backends", "numpy", "--max-new-tokens", "2",
              code=7).output
    assert f"cannot write the goldens {blocker / 'g.json'}" in out and "Traceback" not in out
    out = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "o", *SMALL, "--no-verify", "--dump-dir",
              blocker / "dumps", code=7).output
    assert f"cannot write the dumps to {blocker / 'dumps'}" in out and not (tmp_path / "o").exists()
    # a report path checked before the compile: OUT was published, then exit 7 ("nothing published")
    out = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "o", *SMALL, "--no-verify", "--report",
              blocker / "r.html", code=7).output
    assert f"cannot write the report {blocker / 'r.html'}" in out and not (tmp_path / "o").exists()


def test_goldens_are_recorded_from_the_blobs_unless_told(compiled, tmp_path):
    """Recorded on numpy by default, goldens checked where they were recorded never ran the
    blobs `kvc run` serves (a prefill blob whose positions stopped at 33 passed them)."""
    goldens = tmp_path / "goldens.json"
    assert "from openvino into" in kvc("verify", compiled, "--record", goldens, "--max-new-tokens", "2").output
    report = json.loads(kvc("verify", compiled, "--goldens", goldens, "--json").stdout)
    assert {r["backend"] for r in report["results"]} == {"openvino"} and report["ok"]


def test_goldens_are_checked_on_the_backend_that_recorded_them(compiled, tmp_path):
    """Goldens recorded from the blobs were checked on numpy's IR run (the first of the
    default --backends), which a bad blob does not change: without --backends they are checked
    where they were recorded; with it, on each backend listed. A goldens file holding no
    prompt, or not saying which backend recorded it, is refused."""
    goldens = tmp_path / "goldens.json"
    kvc("verify", compiled, "--record", goldens, "--backends", "openvino", "--max-new-tokens", "4")
    report = json.loads(kvc("verify", compiled, "--goldens", goldens, "--json").stdout)
    assert {r["backend"] for r in report["results"]} == {"openvino"} and report["ok"]
    report = json.loads(kvc("verify", compiled, "--goldens", goldens, "--backends", "numpy,openvino", "--json").stdout)
    assert [r["backend"] for r in report["results"]].count("numpy") == len(report["results"]) // 2
    assert report["backend"] == "numpy,openvino"
    data = json.loads(goldens.read_text())
    for damage, message in ((lambda d: d.update(prompts=[]), "hold no prompt"),
                            (lambda d: d.pop("backend"), "which backend recorded them"),
                            (lambda d: d.update(prompts="x"), "hold no prompt"),
                            # each a KeyError (exit 1), or taken as they were
                            (lambda d: d.pop("openvino_version"), "which OpenVINO recorded them"),
                            (lambda d: d.pop("kv_element_type"), "which cache recorded them"),
                            (lambda d: d.update(kv_element_type=["f16"]), "which cache recorded them"),
                            # each an IndexError or a usage error without the file before
                            (lambda d: d["prompts"][1].update(top_logits=[[["a", "b"]]]), "prompt 1 is not a recorded"),
                            (lambda d: d["prompts"][0].update(tokens=[]), "prompt 0 is not a recorded"),
                            (lambda d: d["prompts"][2]["top_logits"][0][0].__setitem__(0, 10**9),
                             "prompt 2 holds token id 1000000000, past the model's vocabulary")):
        bad = json.loads(json.dumps(data))
        damage(bad)
        goldens.write_text(json.dumps(bad))
        out = kvc("verify", compiled, "--goldens", goldens, code=3).output
        assert message in out and "[bad-goldens]" in out and str(goldens) in out
    goldens.write_text("[]")
    assert "not a kvc goldens file" in kvc("verify", compiled, "--goldens", goldens, code=3).output


def test_goldens_accept_a_changed_token_only_at_a_near_tie():
    """A token may change where the recorded top two are within twice the drift bound (each
    may drift by it) and the logits up to it stay within the bound; at a larger margin, to a
    token outside the recorded top 5, with drift past the bound at that step, or with a NaN
    anywhere, it fails."""
    from kvc.verify.goldens import judge_entry

    entry = {"tokens": [5, 7], "top_logits": [[[5, 10.0], [6, 9.995], [1, 4.0]], [[7, 3.0], [2, 1.0]]]}

    def run(tokens, first_step, later=0.0):
        logits = np.zeros((2, 10), np.float32)
        for t, v in first_step.items():
            logits[0, t] = v
        logits[1, :] = later
        return tokens, list(logits)

    tie = judge_entry(entry, *run([6, 9], {5: 9.998, 6: 9.999, 1: 4.0}), atol=0.01)
    assert tie["ok"] and tie["near_tie"]
    assert tie["reason"].startswith("near-tie: token 0 changed: 5 -> 6") and tie["max_logit_drift"] < 0.01
    wide = dict(entry, top_logits=[[[5, 10.0], [6, 9.9], [1, 4.0]], entry["top_logits"][1]])
    assert not judge_entry(wide, *run([6, 9], {5: 9.95, 6: 9.96, 1: 4.0}), atol=0.01)["ok"]
    assert not judge_entry(entry, *run([8, 9], {5: 10.0, 6: 9.995, 1: 4.0, 8: 10.5}), atol=0.01)["ok"]
    assert not judge_entry(entry, *run([6, 9], {5: 9.9, 6: 9.999, 1: 4.0}), atol=0.01)["ok"]
    assert not judge_entry(entry, *run([6, 9], {5: 9.998, 6: 9.999, 1: 4.0}, later=np.nan), atol=0.01)["ok"]
    assert judge_entry(entry, *run([5, 7], {5: 10.0, 6: 9.995, 1: 4.0}, later=0.0), atol=0.01)["reason"] \
        .startswith("logit drift")  # step 1's recorded 3.0 read as 0.0
    # the bf16 bound is numpy's: a numpy bool stopped `kvc verify --goldens --json` (internal error)
    assert type(judge_entry(entry, *run([5, 7], {5: 10.0, 6: 9.995, 1: 4.0}, 3.0), atol=np.float32(0.01))["ok"]) is bool


def test_goldens_recorded_at_bf16_are_checked_with_the_recordings_rounding(compiled, tmp_path):
    """Goldens recorded from bf16 CPU blobs and checked on numpy's exact run failed by the
    recording's own rounding (drift 0.015-0.024 against f16 KV's 1e-2): the bound is the larger
    of the recording arithmetic's (named in the file) and the checking run's. The goldens below
    stand for a recording on another compile of the same weights: on the directory that
    recorded them, an arithmetic it does not run is an edited file, refused."""
    from kvc.export.compile import cpu_precision
    from kvc.verify.goldens import drift_bound

    goldens = tmp_path / "goldens.json"
    kvc("verify", compiled, "--record", goldens, "--backends", "openvino", "--max-new-tokens", "4")
    assert json.loads(goldens.read_text())["inference_precision"] == cpu_precision("auto")  # the blobs'
    kvc("verify", compiled, "--record", goldens, "--backends", "numpy", "--max-new-tokens", "4")
    data = json.loads(goldens.read_text())
    assert data["inference_precision"] is None  # numpy's: exact
    bf16 = drift_bound(data, "openvino", {"INFERENCE_PRECISION_HINT": "bf16"})
    assert bf16 > 0.02, bf16  # room between f16 KV's 1e-2 and bf16's bound at these logits
    for entry in data["prompts"]:  # every recorded logit off by 0.015: a bf16 recording's rounding
        entry["top_logits"] = [[[t, v + 0.015] for t, v in step] for step in entry["top_logits"]]
    goldens.write_text(json.dumps({**data, "backend": "openvino", "inference_precision": "bf16"}))
    out = kvc("verify", compiled, "--goldens", goldens, "--backends", "numpy", code=3).output
    assert "does not run openvino at (edited?)" in out and "[bad-goldens]" in out
    data["recorded_from"]["directory"] = "another compile"
    for precision, code in (("bf16", 0), ("f32", 4)):
        goldens.write_text(json.dumps({**data, "backend": "openvino", "inference_precision": precision}))
        report = json.loads(kvc("verify", compiled, "--goldens", goldens, "--backends", "numpy", "--json",
                                code=code).stdout)
        assert report["ok"] is (code == 0) and all(r["backend"] == "numpy" for r in report["results"])
    goldens.write_text(json.dumps({**data, "inference_precision": "int4"}))
    assert "an arithmetic kvc does not know" in kvc("verify", compiled, "--goldens", goldens, code=3).output


def test_goldens_take_their_bound_from_the_steps_a_check_compares(compiled, tmp_path):
    """A logit recorded after a changed token is never compared, and sets no bound: before,
    one step of logit 1000 appended after a changed token (the red team's edited file) made a
    bf16 recording's bound 8, which excused that change as a near-tie (margin <= 2 x bound) and
    said OK. Goldens naming numpy at an arithmetic numpy never runs are refused outright."""
    goldens = tmp_path / "goldens.json"
    kvc("verify", compiled, "--record", goldens, "--backends", "numpy", "--max-new-tokens", "6")
    data = json.loads(goldens.read_text())
    data.update(backend="openvino", inference_precision="bf16")  # another compile of these weights, at bf16
    data["recorded_from"]["directory"] = "another compile"
    entry = data["prompts"][0]
    (t0, v0), (t1, v1) = entry["top_logits"][4][:2]
    entry["tokens"][4] = t1  # the run gives t0 here: recorded as t1, ahead of t0 by 1
    entry["top_logits"][4] = [[t1, v0 + 1.0], [t0, v0]]
    entry["top_logits"][5] = [[entry["tokens"][5], 1000.0]]  # after the change: never compared
    goldens.write_text(json.dumps(data))
    report = json.loads(kvc("verify", compiled, "--goldens", goldens, "--backends", "numpy", "--json",
                            code=4).stdout)
    row = report["results"][0]
    assert not row["ok"] and row["first_divergent_token"] == 4 and row["bound"] < 0.5, row
    assert v0 + 1.0 - v1 > 2 * row["bound"]  # the change is no near-tie at the compared steps' scale
    goldens.write_text(json.dumps({**data, "backend": "numpy"}))
    assert "numpy runs exact" in kvc("verify", compiled, "--goldens", goldens, code=3).output


def test_goldens_of_other_weights_are_refused(compiled, tmp_path):
    """Goldens say what they were recorded from: checked on a compile of other weights (here the
    same Llama with int8 weights), they are refused by name, not judged token by token."""
    goldens, other = tmp_path / "goldens.json", tmp_path / "other"
    kvc("verify", compiled, "--record", goldens, "--backends", "numpy", "--max-new-tokens", "2")
    kvc("compile", fixtures.path("llama_int8"), "-o", other, *SMALL, "--no-verify")
    out = kvc("verify", other, "--goldens", goldens, "--backends", "numpy", code=3).output
    assert "recorded from other weights" in out and "[bad-goldens]" in out and str(goldens) in out


def test_goldens_drift_bound_follows_the_arithmetic():
    """1e-4 exact; 1e-2 for f16 KV; bf16 CPU arithmetic: two bf16 units at the largest recorded
    |logit| (5.2: 2 x 2^(2-7) = 0.0625), never below 1e-2."""
    from kvc.verify.goldens import drift_bound

    data = {"kv_element_type": "f32", "prompts": [{"top_logits": [[[1, 5.2], [2, -3.0]]]}]}
    assert drift_bound(data, "openvino", {"INFERENCE_PRECISION_HINT": "f32"}) == 1e-4
    assert drift_bound(data, "numpy", {}) == 1e-4
    assert drift_bound({**data, "kv_element_type": "f16"}, "openvino", {"INFERENCE_PRECISION_HINT": "f32"}) == 1e-2
    assert drift_bound(data, "openvino", {"INFERENCE_PRECISION_HINT": "bf16"}) == 0.0625
    small = {"kv_element_type": "f32", "prompts": [{"top_logits": [[[1, 0.5]]]}]}
    assert drift_bound(small, "openvino", {"INFERENCE_PRECISION_HINT": "bf16"}) == 1e-2


def test_diff_models_and_dump_steps(compiled, tmp_path):
    dumps = compiled / "dumps" / "prefill"
    kv_io_step = next(dumps.glob("*-kv-io.txt"))
    out = kvc("diff", dumps / "000-input.txt", kv_io_step).output
    assert out.startswith("# ops: +") and "+8 Convert" in out.splitlines()[0]  # the f16 KV inputs and outputs
    assert kvc("diff", fixtures.path("llama"), fixtures.path("llama")).output == "identical\n"
    data = json.loads(kvc("diff", compiled / "prefill.xml", compiled / "generate-128.xml", "--json").stdout)
    assert not data["identical"] and data["summary"]["op_delta"]["Slice"] == -1  # generate has no logits slice
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    assert "not a kvc IR dump" in kvc("diff", notes, dumps / "000-input.txt", code=2).output
    assert "[unknown-format]" in kvc("diff", compiled / "manifest.json", dumps / "000-input.txt", code=3).output


def test_inspect_model_and_json():
    out = kvc("inspect", fixtures.path("gpt2")).output
    assert "kv cache: 2 layers, stateful (variables)" in out
    data = json.loads(kvc("inspect", fixtures.path("gpt2", "stateless"), "--json").stdout)
    assert data["kv_layout"]["stateful"] is False and data["parameters"] > 0


def test_passes_listing():
    out = kvc("passes").output
    for name in ("lift-state", "fuse-kvcache", "lower-kvcache", "static-shape", "kv-io", "mask-positions"):
        assert f"{name}: " in out
    data = json.loads(kvc("passes", "--json").stdout)
    assert data["passes"]["lift-state"]["options"][0]["choices"] == ["drop", "keep"]


@register_pass
@dataclass(frozen=True)
class PerturbConstant(Pass):
    """Test only: scale one weight by 1.01, the kind of bug bisect must find."""

    name: ClassVar[str] = "test-perturb-constant"

    def run(self, model):
        import openvino.opset13 as ops

        node = next(n for n in model.get_ordered_ops()
                    if n.get_friendly_name() == "self.model.layers.1.mlp.up_proj.weight")
        scaled = ops.constant(np.asarray(node.get_data()) * np.float32(1.01))
        scaled.set_friendly_name(node.get_friendly_name())
        node.output(0).replace(scaled.output(0))
        return PassResult(model, True)


def test_bisect_finds_the_broken_pass_and_tensor():
    result = kvc("bisect", fixtures.path("llama"), *SMALL, "--passes", "lift-state,test-perturb-constant",
                 "--json", code=4)
    data = json.loads(result.stdout)
    assert data["first_bad_pass"]["spec"] == "test-perturb-constant"
    # The first value computed from the scaled weight: layer 1's up-projection MatMul output.
    assert data["first_diverging_tensor"]["tensor"] == "442"
    # The weight itself is compared with the source's after every pass, and named.
    assert ("pass test-perturb-constant changes the model: its weight "
            "'self.model.layers.1.mlp.up_proj.weight' (f32 [128, 64]) differs from the source's in 8192 of 8192 "
            "values, first at [0, 0]") in result.output
    assert "; first diverging tensor: 442" in result.output


def test_bisect_clean_pipeline():
    data = json.loads(kvc("bisect", fixtures.path("mistral"), *SMALL, "--prefill-chunk-size", "16", "--json").stdout)
    assert data["ok"] and data["first_bad_pass"] is None
    # Each pass is judged alone: on a sliding window static-shape breaks the numbers and
    # mask-positions restores them, so static-shape is shown as restored, not blamed.
    rows = {(s["branch"], s["spec"]): s for s in data["stages"]}
    shaped = rows[("prefill", "static-shape{kind=prefill,prompt=64,chunk=16}")]
    assert not shaped["ok"] and shaped["restored"]
    assert rows[("prefill", "mask-positions")]["ok"] and not rows[("prefill", "mask-positions")]["restored"]
    out = kvc("bisect", fixtures.path("mistral"), *SMALL, "--prefill-chunk-size", "16").output
    assert "changed, restored later" in out and "no pass changes the outputs beyond tolerance" in out


def test_bisect_names_the_one_branch_pass_and_its_tensor(monkeypatch):
    """A pass inside a static branch that breaks the numbers is named alone (not merged with
    static-shape), with the first tensor it changes."""
    import kvc.export.build as build

    real = build.branch_passes

    def with_perturbation(options):
        branches = real(options)
        branches["prefill"].insert(4, PerturbConstant())  # after unmask-pad-rows
        return branches

    monkeypatch.setattr(build, "branch_passes", with_perturbation)
    data = json.loads(kvc("bisect", fixtures.path("llama"), *SMALL, "--kv-precision", "f32", "--json", code=4).stdout)
    assert data["first_bad_pass"]["spec"] == "test-perturb-constant"
    assert data["first_bad_pass"]["branch"] == "prefill" and data["first_bad_pass"]["index"] == 5
    assert data["first_diverging_tensor"]["tensor"] == "442"


PLUGIN = """
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult
from kvc.passes.framework.registry import register_pass


@register_pass
@dataclass(frozen=True)
class ScaleLogits(Pass):
    '''Plugin test: doubles the logits.'''

    name: ClassVar[str] = "plugin-scale-logits"

    def run(self, model):
        result = next(r for r in model.get_results() if "logits" in r.output(0).get_names())
        doubled = ops.multiply(result.input_value(0), ops.constant(np.float32(2)))
        result.input(0).replace_source_output(doubled.output(0))
        return PassResult(model, True)
"""


def test_pass_plugin_file_is_listed_and_bisected(tmp_path):
    plugin = tmp_path / "my_pass.py"
    plugin.write_text(PLUGIN)
    assert "plugin-scale-logits: Plugin test: doubles the logits." in kvc("passes", "--pass-plugin", plugin).output
    result = kvc("bisect", fixtures.path("llama"), *SMALL, "--pass-plugin", plugin,
                 "--passes", "lift-state,plugin-scale-logits", "--json", code=4)
    data = json.loads(result.stdout)
    assert data["first_bad_pass"]["spec"] == "plugin-scale-logits" and data["first_bad_pass"]["branch"] == "common"


@pytest.mark.parametrize("content,message", [
    (None, "expected an existing .py file"),
    ("raise RuntimeError('boom')", "failed to import: RuntimeError: boom"),
    ("import sys; sys.exit(0)", "failed to import: SystemExit: 0"),  # was `kvc compile` exit 0, no output
    ("x = 1", "registered no pass"),
])
def test_bad_pass_plugins_are_usage_errors(tmp_path, content, message):
    plugin = tmp_path / "bad_plugin.py"
    if content is not None:
        plugin.write_text(content)
    result = kvc("passes", "--pass-plugin", plugin, code=2)
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("body,message", [
    ("raise RuntimeError('boom in pass')", "raised RuntimeError: boom in pass"),
    ("import sys; sys.exit(0)", "raised SystemExit: 0"),
    ("return 42", "returned int, not a PassResult"),
    ("return self.run(model)", "raised RecursionError"),
])
def test_a_plugin_pass_that_fails_is_a_pass_failure_naming_it(tmp_path, body, message):
    """Errors in a plugin's pass were kvc's "internal error" (exit 1), and its sys.exit(0) a
    compile that ended with status 0 and nothing written."""
    name = f"plugin-bad-{len(body)}"  # one per case: the registry is the process's
    plugin = tmp_path / "bad_pass.py"
    plugin.write_text(PLUGIN.replace("plugin-scale-logits", name).replace(
        "        result = next(r for r", f"        {body}\n        result = next(r for r"))
    out = tmp_path / "out"
    result = kvc("compile", fixtures.path("llama"), "-o", out, *SMALL, "--pass-plugin", plugin,
                 "--passes", f"lift-state,{name}", code=6)
    assert name in result.output and f"(from {plugin})" in result.output and message in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_unexpected_errors_are_internal_with_exit_1(monkeypatch):
    import kvc.ir.describe as describe

    monkeypatch.setattr(describe, "describe", lambda *a, **k: 1 / 0)
    result = CliRunner().invoke(cli, ["inspect"])
    assert result.exit_code == 1 and "internal error: ZeroDivisionError" in result.output
    assert "Traceback" not in result.output
    debug = CliRunner().invoke(cli, ["--debug", "inspect"])
    assert debug.exit_code == 1 and "Traceback" in debug.output


def test_installed_console_script_compile_run_verify(tmp_path):
    exe = shutil.which("kvc", path=os.path.dirname(sys.executable))
    assert exe, "the kvc console script is not installed next to this Python"
    out = tmp_path / "out"

    def sh(*args):
        return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, check=True).stdout

    sh("compile", fixtures.path("phi"), "-o", out, *SMALL, "--prefill-chunk-size", "16", "--device", "CPU")
    golden = fixtures.goldens("phi")["prompts"][2]
    data = json.loads(sh("run", out, "--prompt-ids", ",".join(map(str, golden["ids"])), "--max-new-tokens", "24", "--ignore-eos",
                         "--json"))
    assert data["tokens"] == golden["tokens"]["openvino"]
    assert "verification: OK" in sh("verify", out, "--backends", "numpy,openvino", "--max-new-tokens", "8")


def test_version_is_the_installed_packages():
    import importlib.metadata

    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and result.output == f"kvc, version {importlib.metadata.version('kvc')}\n"


def test_the_command_line_starts_without_networkx():
    """Every kvc invocation imports the CLI and kvc.ir; networkx (0.26 s of a 0.7 s start) is
    imported only by what uses it, `kvc.ir.graph` and the report (the hostile corpus alone
    runs kvc 139 times)."""
    code = "import sys, kvc.cli.main, kvc.ir; print('networkx' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_compile_debug_rules_prints_matches_and_misses(tmp_path):
    result = kvc("compile", fixtures.path("mistral"), "-o", tmp_path / "out", *SMALL, "--no-verify", "--debug-rules")
    assert "// rule mask-positions/index-compare: 2 match(es)" in result.output
    assert "// rule unmask-pad-rows/bool-mask did not match at ScaledDotProductAttention" in result.output
    assert "the mask is f32, not boolean" in result.output


def test_pass_plugins_load_from_entry_points(tmp_path, monkeypatch):
    import importlib.metadata

    from kvc.errors import UsageError
    from kvc.passes.framework import plugins

    (tmp_path / "kvc_ep_plugin.py").write_text(PLUGIN.replace("plugin-scale-logits", "ep-scale-logits"))
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = importlib.metadata.EntryPoint("ep-scale-logits", "kvc_ep_plugin", plugins.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [ep] if group == plugins.ENTRY_POINT_GROUP else [])
    assert plugins.load_entry_points() == ["ep-scale-logits"]
    assert "ep-scale-logits: Plugin test: doubles the logits." in kvc("passes").output
    broken = importlib.metadata.EntryPoint("broken", "no_such_module_kvc", plugins.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [broken])
    with pytest.raises(UsageError, match="entry point broken = no_such_module_kvc failed to load: ModuleNotFoundError"):
        plugins.load_entry_points()


def test_a_reader_that_goes_away_does_not_stop_a_compile(tmp_path):
    """`kvc compile ... 2>&1 | head -1`: the compile still finishes and publishes its output."""
    exe = shutil.which("kvc", path=os.path.dirname(sys.executable))
    out = tmp_path / "out"
    child = subprocess.Popen([exe, "compile", str(fixtures.path("llama")), "-o", str(out), *SMALL, "--no-verify"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert child.stdout.readline().startswith(b"[kvc] ")
    child.stdout.close()  # the reader leaves
    assert child.wait(timeout=300) == 0
    assert (out / "manifest.json").is_file()


def test_summaries_name_the_bundled_model_order_prefill_first_and_say_what_weights_count(tmp_path):
    out = tmp_path / "out"
    result = kvc("compile", "-o", out, *SMALL, "--variants", "96")
    assert "[kvc] loading the bundled model (llama)" in result.output and "site-packages" not in result.output
    assert f"compiled the bundled model (llama) -> {out}" in result.output
    listed = [line.split()[0] for line in kvc("inspect", out).output.splitlines()
              if line.startswith(("prefill", "generate-"))]
    assert listed == ["prefill", "generate-96", "generate-128"]
    assert "on disk: every constant of every model once" in result.output
    assert "of constants (the sum of their sizes" in kvc("inspect").output


def test_diff_dump_and_compiled_directories_step_by_step(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    kvc("compile", "-o", a, *SMALL, "--dumps", "--no-verify")
    kvc("compile", "-o", b, *SMALL, "--dumps", "--no-verify", "--kv-precision", "int8")
    out = kvc("diff", a / "dumps", b / "dumps", "--summary-only").output
    assert "prefill/004-unmask-pad-rows.txt: identical" in out  # the steps before kv-io are the same
    assert re.search(r"prefill/005-kv-io.txt: \d+ lines differ \(ops .*Round \+4", out)
    data = json.loads(kvc("diff", a, b, "--json").output)
    models = set(json.loads((a / "manifest.json").read_text())["models"])
    assert {"prefill", "generate-128"} <= models  # and first-16 where the CPU computes at bf16
    assert data["kind"] == "compiled" and {p["name"] for p in data["pairs"]} == models
    assert not any(p["identical"] for p in data["pairs"]) and any("kv_precision" in h for h in data["header"])
    plain = kvc("diff", a, b).output
    assert "\x1b[" not in plain and "+++ " in plain  # not a terminal: no colour by default
    assert "\x1b[32m+" in kvc("diff", a, b, "--color", "always").output
    assert "identical" in kvc("diff", a / "dumps", a / "dumps").output.splitlines()[0]
    assert "cannot compare a compiled with a model" in kvc("diff", a, a / "prefill.xml", code=2).output
    # The same graphs deployed differently (a blob's precision, the tokenizer) were reported identical.
    c = tmp_path / "c"
    shutil.copytree(a, c, ignore=shutil.ignore_patterns("dumps"))
    m = json.loads((c / "manifest.json").read_text())
    blob = m["models"]["generate-128"]["blobs"]["CPU"]
    was = blob["import_config"]["INFERENCE_PRECISION_HINT"]  # the host's: f32, or bf16 with AVX512_BF16
    blob["import_config"]["INFERENCE_PRECISION_HINT"] = other = "f32" if was == "bf16" else "bf16"
    m["files"]["tokenizer.json"]["sha256"] = "0" * 64
    (c / "manifest.json").write_text(json.dumps(m))
    out = kvc("diff", a, c, "--summary-only").output
    assert "deployment differs:" in out and "generate-128: identical" in out
    assert f'blobs.generate-128.CPU.import_config.INFERENCE_PRECISION_HINT: "{was}" -> "{other}"' in out
    assert 'files.tokenizer.json: "' in out
    assert "deployment differs" not in kvc("diff", a, a, "--summary-only").output


def test_progress_is_a_bar_per_phase_on_a_terminal_and_plain_lines_elsewhere(tmp_path):
    import io

    from kvc.cli.options import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    messages = ["compiling prefill, generate-128 for CPU", "compiled for CPU (1/2): prefill",
                "compiled for CPU (2/2): generate-128", "checking the CPU blobs (1/4)", "done"]
    term, log = Terminal(), io.StringIO()
    for sink in (term, log):
        progress = Progress(sink)
        for m in messages:
            progress(m)
    assert log.getvalue().splitlines() == [f"[kvc] {m}" for m in messages]
    lines = term.getvalue().split("\n")
    assert lines[1].count("\r") == 2 and lines[1].endswith("[kvc] compiled for CPU [" + "#" * 24 + "] 2/2 generate-128")
    assert "[kvc] checking the CPU blobs [######..................] 1/4" in lines[2] and lines[3] == "[kvc] done"
    # not a terminal: plain, counted lines (a chunk of 32 after a first chunk of 32 static rows, on
    # any host: seven probes, the two from position 0, the chunk's and the first chunk's pad
    # probes, and the three far ones, the generate variant's over empty rows and over a far past,
    # each prefilled and decoded)
    out = kvc("compile", "-o", tmp_path / "o", *SMALL, "--prefill-chunk-size", "32", "--prefill-first", "32",
              "--prefill-first-rows", "static").output
    for line in ("[kvc] compiled for CPU (2/2): generate-128", "[kvc] verifying: probes on kvc's numpy runtime (7/7)",
                 "[kvc] checking the CPU blobs (14/14)"):
        assert line in out


def test_json_output_is_strict_json_with_nan_and_infinities_spelled_out(capsys):
    """kvc bisect --json of a run with NaN metrics printed a bare NaN, which is not JSON."""
    from kvc.cli.render import echo_json

    echo_json({"max_abs": float("nan"), "rows": [float("inf"), -float("inf"), 1.5], "ok": False})
    assert json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"bare {c}")) == {
        "max_abs": "NaN", "rows": ["Infinity", "-Infinity", 1.5], "ok": False}
    echo_json({"ok": np.True_, "drift": np.float32(np.nan), "steps": np.int64(3)})  # numpy's scalars as Python's
    assert json.loads(capsys.readouterr().out) == {"ok": True, "drift": "NaN", "steps": 3}


def test_bisect_walks_the_models_compile_builds(monkeypatch):
    """`kvc compile` resolves its auto options for the CPU at the plugin's own arithmetic, and
    points a refused compile to `kvc bisect`, which resolved them at f32: on a bf16 host it
    walked a prefill chunked by 32 with a dynamic first chunk where the compile built chunks of
    16 after a static first 16, and a fault in the models compiled was in none it walked (the
    chunk model reading none of its past beyond C, chunk_past_beyond_C_ignored, is no fault
    when C = P / 2: exit 0)."""
    import kvc.export.compile as compile_module
    from tests.mutation.mutants import apply_in_passes

    real = compile_module.cpu_precision
    monkeypatch.setattr(compile_module, "cpu_precision", lambda p: "bf16" if p == "auto" else real(p))
    applied = apply_in_passes("chunk_past_beyond_C_ignored", monkeypatch.setattr)
    data = json.loads(kvc("bisect", fixtures.path("llama"), *SMALL, "--json", code=4).stdout)
    assert "static-shape{kind=prefill,prompt=64,chunk=16}" in {s["spec"] for s in data["stages"]}
    bad = data["first_bad_pass"]
    assert applied.edits == {"prefill": 1} and (bad["branch"], bad["spec"]) == ("prefill", applied.last["prefill"])
    # --inference-precision f32 bisects what `kvc compile --inference-precision f32` builds
    clean = json.loads(kvc("bisect", fixtures.path("llama"), *SMALL, "--inference-precision", "f32", "--json").stdout)
    assert "static-shape{kind=prefill,prompt=64,chunk=32}" in {s["spec"] for s in clean["stages"]}


@pytest.mark.parametrize("mutant,options,branch,call", [
    # positions clamped at P - 1: one step over half the past (position 63) ran below the clamp
    ("gen_positions_clamped_to_P", (), "generate-128", "1 token over 127 cached"),
    # the past's last slot never attended: empty in a step over half the past
    ("gen_last_past_slot_masked", (), "generate-128", "1 token over 127 cached"),
    # a slot 9 before the mask's end attended by every row: a pad only in a call of 8 tokens or fewer
    ("chunk_pad_slot_attended", ("--prefill-chunk-size", "16", "--prefill-first", "16"), "prefill",
     "1 token over 24 cached"),
    # a first chunk of dynamic rows, wrong for 8 to F - 1 rows: no stage of it was judged at all
    ("first_dynamic_rows_8_up", ("--prefill-chunk-size", "16", "--prefill-first", "32", "--prefill-first-rows",
                                 "dynamic", "--inference-precision", "f32"), "first-32", "29 tokens over 0 cached"),
])
def test_bisect_runs_the_steps_the_compile_probes(monkeypatch, mutant, options, branch, call):
    """kvc compile refuses each of these faults (tests/mutation/test_mutants.py) and sends the
    user to kvc bisect, which judged a static stage on one step (half the past, the call full)
    and skipped a stage whose rows are dynamic: it said no pass changes the outputs (exit 0).
    Each stage is judged on the steps that reach a model's last slots and positions and its pad
    rows; the pass that holds the fault is named with the call it fails on."""
    from tests.mutation.mutants import apply_in_passes

    applied = apply_in_passes(mutant, monkeypatch.setattr)
    result = kvc("bisect", fixtures.path("llama"), *SMALL, *options, code=4)
    assert list(applied.edits) == [branch]
    assert f"first bad pass: {applied.last[branch]} ({branch}, pass " in result.output
    assert f"on a call of {call}" in result.output and "first diverging tensor" in result.output


@pytest.mark.parametrize("options", [(), ("--device", "NPU")], ids=["cpu", "npu-values-last"])
def test_bisect_compares_the_cache_rows_a_step_writes(monkeypatch, options):
    """A chunk model that writes layer 1's keys into its values' buffer and back computes the
    right logits in the step itself; kvc compile refuses it by the cache rows, and kvc bisect,
    which compared logits alone, said no pass changes the outputs (exit 0). It compares each
    step's new cache rows too, read back from the NPU's values-last layout (with no false
    failure: a clean bisect of the same options is exit 0)."""
    from tests.mutation.mutants import apply_in_passes

    clean = json.loads(kvc("bisect", fixtures.path("llama"), *SMALL, *options, "--json").stdout)
    assert clean["ok"]
    applied = apply_in_passes("chunk_swap_present_kv_layer1", monkeypatch.setattr)
    result = kvc("bisect", fixtures.path("llama"), *SMALL, *options, code=4)
    assert f"first bad pass: {applied.last['prefill']} (prefill, pass " in result.output
    assert "the cache rows it writes to present.1." in result.output


def test_bisect_an_int8_cache(monkeypatch):
    """kvc bisect with --kv-precision int8 stopped at exit 2 (missing input
    past_key_values.1.value_scale: it placed no scales). Its stages run widened and exact, as
    the compile's IR check: a clean pipeline passes, and an o_proj 10% too large, which an
    int8 cache's f16 scales had put under f16's NRMSE 0.01, is named."""
    from tests.mutation.mutants import apply_in_passes

    clean = json.loads(kvc("bisect", fixtures.path("llama"), *SMALL, "--kv-precision", "int8", "--json").stdout)
    assert clean["ok"] and any("kv_type=i8" in s["spec"] for s in clean["stages"])
    applied = apply_in_passes("gen_o_proj_1e1", monkeypatch.setattr)
    result = kvc("bisect", fixtures.path("llama"), *SMALL, "--kv-precision", "int8", code=4)
    assert f"first bad pass: {applied.last['generate-128']} (generate-128, pass " in result.output


def test_bisect_names_a_mask_positions_that_fails_to_restore(monkeypatch):
    """On a sliding window static-shape diverges by design and mask-positions restores it; a
    mask-positions that numbered the past from 1 left the outputs wrong from static-shape on,
    and bisect named static-shape. It names the mask-positions that rewrote the model."""
    from tests.mutation.mutants import apply_in_passes

    apply_in_passes("mask_positions_past_from_one", monkeypatch.setattr)
    data = json.loads(kvc("bisect", fixtures.path("starcoder2"), *SMALL, "--json", code=4).stdout)
    assert data["first_bad_pass"]["spec"] == "mask-positions"
    assert data["first_diverging_tensor"] is not None
    shape = next(s for s in data["stages"] if s["branch"] == data["first_bad_pass"]["branch"] and s["index"] == 1)
    assert shape["spec"].startswith("static-shape") and not shape["ok"] and not shape["restored"]


def test_bisect_forces_every_pair_of_experts(monkeypatch):
    """A generate graph that scattered expert 5's routing weight into expert 6's column only
    for a token routed to 0 and 5 together: the compile refuses it (its forced probe spans
    every round of experts), but bisect forced one row over one round only, where no token
    takes 0 and 5, and said no pass changes the outputs (exit 0)."""
    from tests.mutation.mutants import apply_in_passes

    applied = apply_in_passes("gen_pair_0_5_weight_to_6", monkeypatch.setattr)
    result = kvc("bisect", fixtures.path("qwen2_moe"), *SMALL, code=4)
    assert f"first bad pass: {applied.last['generate-128']} (generate-128, pass " in result.output
    assert "every router forced" in result.output
