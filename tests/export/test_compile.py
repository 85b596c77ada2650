"""compile_to: a complete compiled directory or nothing; shared weights; blobs; manifest."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
from typing import ClassVar

import kvc.ir as ir
from kvc import fixtures
from kvc.errors import DeviceError, UsageError, VerificationError
from kvc.export.build import build_static
from kvc.passes.framework.base import Pass, PassResult
from kvc.plan import StaticOptions
from kvc.export.compile import CompileOptions, compile_to
from kvc.export.load import open_compiled
from kvc.export.manifest import read_manifest
from tests.cli.runner import SMALL as CLI_SMALL, kvc

SMALL = StaticOptions(max_prompt_len=64, min_response_len=32, variants=(80,))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("c") / "llama-npu"
    compile_to(fixtures.path("llama"), out, CompileOptions(SMALL, devices=("CPU", "NPU"), dumps=True))
    return out


def test_layout_and_manifest(compiled):
    names = sorted(p.name for p in compiled.iterdir())
    m = read_manifest(compiled)
    tokenizer = ["config.json", "generation_config.json", "openvino_detokenizer.bin", "openvino_detokenizer.xml",
                 "openvino_tokenizer.bin", "openvino_tokenizer.xml", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(m["tokenizer"]) == tokenizer
    assert names == sorted(["dumps", "generate-128.CPU.blob", "generate-128.NPU.blob", "generate-128.xml",
                            "generate-80.CPU.blob", "generate-80.NPU.blob", "generate-80.xml", "manifest.json",
                            "prefill.CPU.blob", "prefill.NPU.blob", "prefill.xml", "weights.bin", *tokenizer])
    assert m["openvino_version"] and m["kvc_version"]
    from kvc.export.manifest import kvc_build

    assert m["kvc_build"] == kvc_build() and len(kvc_build()) == 16
    assert m["plan"]["lengths"]["generate_sizes"] == [80, 128] and m["plan"]["lengths"]["capacity"] == 128
    assert m["plan"]["lengths"]["adjustments"] == ["min response length 32 aligned up to 64 (multiple of 64)",
                                           "generate variant 128 (= P + R) added: the largest variant must hold the capacity"]
    assert [k["input"] for k in m["plan"]["kv"]][:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    gen = m["models"]["generate-80"]
    assert {i["name"]: i["shape"] for i in gen["inputs"]}["attention_mask"] == [1, 80]
    assert {o["name"]: o["shape"] for o in gen["outputs"]}["present.0.key"] == [1, 2, 1, 16]
    assert set(m["source"]["sha256"]) == {"openvino_model.xml", "openvino_model.bin"}
    assert set(m["files"]) == {n for n in names if n not in ("manifest.json", "dumps")}
    assert m["verification"]["ok"] and all(r["first_divergent_token"] is None for r in m["verification"]["results"])
    # an unchunked prefill has one path: a prompt for its positions (P - 1 tokens), one for its
    # pad rows (1 token: the pad probe), one to switch; then the far probes: each variant's last
    # two positions, over empty rows and over a far past
    assert [(r["prompt_tokens"], r.get("from_position")) for r in m["verification"]["results"]] == [
        (63, None), (7, None), (64, None), (1, None), (1, 78), (1, 78), (1, 126), (1, 126)]
    assert (compiled / "dumps" / "prefill" / "index.json").exists()


def test_outputs_have_the_users_usual_permissions(compiled):
    """Written under temporary names (mkstemp makes 0600), published like any file the user
    makes: a compiled directory is meant to be handed to a service or another user."""
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    assert compiled.stat().st_mode & 0o777 == 0o777 & ~mask
    for path in compiled.iterdir():
        if path.is_file():
            assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path.name


def test_static_xmls_record_static_shapes(compiled):
    """The graphs are serialized without their weights; the shape constants must stay, or
    OpenVINO re-infers shapes without them and writes -1 dimensions into a static model."""
    for xml in compiled.glob("*.xml"):
        if not xml.name.startswith("openvino_"):
            assert "<dim>-1</dim>" not in xml.read_text(), xml.name


def test_one_copy_of_the_weights_on_disk(compiled):
    source_bin = (fixtures.path("llama") / "openvino_model.bin").stat().st_size
    weights = (compiled / "weights.bin").stat().st_size
    assert source_bin <= weights < source_bin * 1.05
    assert [p.name for p in compiled.glob("*.bin") if "tokenizer" not in p.name] == ["weights.bin"]
    for xml in compiled.glob("*.xml"):
        assert xml.stat().st_size < 200_000, "graphs only: the weights live in weights.bin"
    for device in ("CPU", "NPU"):  # NPU: NPUW on its CPU backend, with NPUW_CWAI
        for blob in compiled.glob(f"*.{device}.blob"):
            assert blob.stat().st_size < source_bin / 2, f"{blob.name} is weightless: it reads weights.bin at import"
    imports = read_manifest(compiled)["models"]["prefill"]["blobs"]
    assert imports["NPU"]["import_config"]["WEIGHTS_PATH"] == imports["CPU"]["import_config"]["WEIGHTS_PATH"] \
        == "weights.bin"


def test_weights_stay_shared_in_memory():
    sm = build_static(ir.load(fixtures.path("llama")), SMALL, use_env=False)

    def weight_ptrs(model):
        return {n.get_friendly_name(): np.asarray(n.get_data()).__array_interface__["data"][0]
                for n in model.get_ops() if n.get_type_name() == "Constant" and n.get_byte_size() > 4096}

    ptrs = [weight_ptrs(m) for m in sm.models.values()]
    assert ptrs[0] and all(p == ptrs[0] for p in ptrs), "every variant views the same weight memory"


@pytest.mark.parametrize("backend", ["numpy", "openvino", "npu"])
def test_compiled_directory_runs_from_ir_and_from_blobs(compiled, backend):
    prompt = fixtures.goldens("llama")["prompts"][2]
    ir_run = open_compiled(compiled, backend, from_ir=True).generate(prompt["ids"], 24)
    assert ir_run.tokens == prompt["tokens"]["openvino"]
    if backend != "numpy":
        blob_run = open_compiled(compiled, backend).generate(prompt["ids"], 24)
        assert blob_run.tokens == ir_run.tokens
        np.testing.assert_array_equal(np.stack(blob_run.logits), np.stack(ir_run.logits))


def test_npu_blobs_share_one_weights_bank_named_for_the_weights(compiled):
    """NPUW's blobs name their weights bank (NPUW_WEIGHTS_BANK) for weights.bin's sha256, so
    that the prefill and generate models of an open hold the weights once, and a directory
    with other weights never shares it; the IR, run on the NPU, names the same bank."""
    m = read_manifest(compiled)
    bank = "kvc-" + m["files"]["weights.bin"]["sha256"][:16]
    blobs = [entry["blobs"]["NPU"] for entry in m["models"].values()]
    assert len(blobs) == 3 and {b["compile_config"]["NPUW_WEIGHTS_BANK"] for b in blobs} == {bank}
    assert {b["import_config"]["NPUW_WEIGHTS_BANK"] for b in blobs} == {bank}
    assert all("NPUW_WEIGHTS_BANK" not in entry["blobs"]["CPU"]["compile_config"] for entry in m["models"].values())


def test_opening_npu_blobs_leaves_the_process_cpu_defaults_alone(compiled):
    """NPU blobs import through a Core of their own set to f32: a later CPU compile at the
    plugin's defaults (kvc compile --inference-precision auto) must still get the defaults."""
    from kvc.ir.reader import core

    keys = ("INFERENCE_PRECISION_HINT", "DYNAMIC_QUANTIZATION_GROUP_SIZE")
    before = {k: str(ov.Core().get_property("CPU", k)) for k in keys}
    open_compiled(compiled, "npu").generate([1, 2, 3], 2)
    assert {k: str(core().get_property("CPU", k)) for k in keys} == before


def test_blob_from_another_openvino_version_is_an_actionable_error(compiled, tmp_path):
    import shutil

    copy = tmp_path / "old"
    shutil.copytree(compiled, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["openvino_version"] = "2025.0.0-1-deadbeef"
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DeviceError, match="exported by OpenVINO 2025.0.0-1-deadbeef, but this is OpenVINO .*"
                                          "--from-ir.*kvc compile"):
        open_compiled(copy, "openvino")
    assert open_compiled(copy, "openvino", from_ir=True).generate([1, 2, 3], 2).tokens


def test_out_exists_needs_force(compiled):
    with pytest.raises(UsageError, match="exists; pass --force"):
        compile_to(fixtures.path("llama"), compiled, CompileOptions(SMALL))


def test_failed_compile_leaves_nothing(tmp_path, monkeypatch):
    import kvc.verify.compiled as checks

    def broken(*args, **kwargs):
        return {"against": "test", "ok": False, "results": [{"ok": False, "prompt_tokens": 7, "reason": "forced"}]}

    monkeypatch.setattr(checks, "verify_static", broken)
    with pytest.raises(VerificationError, match="prompt of 7 tokens: forced; nothing was written"):
        compile_to(fixtures.path("llama"), tmp_path / "out", CompileOptions(SMALL))
    assert list(tmp_path.iterdir()) == []


def _reroute(output, make) -> None:
    """Every consumer of `output` reads `make(output)` instead: how the fault passes below edit a
    static model."""
    targets = list(output.get_target_inputs())
    changed = make(output)
    for t in targets:
        t.replace_source_output(changed.output(0))


@dataclasses.dataclass(frozen=True)
class HalvePastValues(Pass):
    """A fault in how a model reads its past: the values of its past rows from `from_row` on
    at half their size. In the prefill (every row) only a chunk over a real past shows it (an
    empty past is masked); in a generate variant from row 64 on, only a variant run nearly
    full."""

    name: ClassVar[str] = "test-halve-past-values"
    from_row: int = 0

    def run(self, model):
        import openvino.opset13 as ops

        for p in model.get_parameters():
            name = p.output(0).get_any_name()
            if name.startswith("past_key_values") and "value" in name:
                rows = p.get_partial_shape()[2].get_length()
                factor = np.where(np.arange(rows) >= self.from_row, 0.5, 1.0).astype(p.get_element_type().to_dtype())
                _reroute(p.output(0), lambda x: ops.multiply(x, ops.constant(factor.reshape(1, 1, rows, 1))))
        return PassResult(model, True)


def _fault_in(monkeypatch, branch: str, fault: Pass) -> None:
    """Append `fault` to the passes of one static model's branch."""
    import kvc.export.build as build

    real = build.branch_passes

    def faulty(options):
        branches = real(options)
        branches[branch] = [*branches[branch], fault]
        return branches

    monkeypatch.setattr(build, "branch_passes", faulty)


@dataclasses.dataclass(frozen=True)
class ScaleLastAttention(Pass):
    """A fault in one layer's attention: its output `factor` times too large."""

    name: ClassVar[str] = "test-scale-last-attention"
    factor: float = 1.3

    def run(self, model):
        import openvino.opset13 as ops

        sdpa = [n for n in model.get_ordered_ops() if n.get_type_name() == "ScaledDotProductAttention"][-1]
        _reroute(sdpa.output(0), lambda x: ops.multiply(x, ops.constant(np.float32(self.factor))))
        return PassResult(model, True)


@dataclasses.dataclass(frozen=True)
class ScaleLastProjection(Pass):
    """A fault of a few percent: the last layer's attention output projection (o_proj) `factor`
    times too large."""

    name: ClassVar[str] = "test-scale-last-projection"
    factor: float = 1.01

    def run(self, model):
        import openvino.opset13 as ops

        proj = [n for n in model.get_ordered_ops() if n.get_type_name() == "MatMul" and "o_proj" in n.get_friendly_name()][-1]
        _reroute(proj.output(0), lambda x: ops.multiply(x, ops.constant(np.float32(self.factor))))
        return PassResult(model, True)


@pytest.mark.parametrize("kv", ["bf16", "f16"])
def test_the_numpy_check_over_a_rounded_cache_is_exact(kv, tmp_path, monkeypatch):
    """Over an f16 or bf16 cache the IR is checked widened (`kvc.verify.compiled.widens`): the
    cache unrounded, the exact rules. The last layer's attention projection 1% too large in the
    generate model alone (a drift about what rounding a bf16 cache leaves) was published by the
    reduced-precision rules, and is refused by the exact ones."""
    import kvc.verify.compiled as compiled

    _fault_in(monkeypatch, "generate-128", ScaleLastProjection())
    options = CompileOptions(dataclasses.replace(ONE_VARIANT, kv_precision=kv))
    with monkeypatch.context() as rounded:  # the check as it was: the cache rounded, reduced precision
        rounded.setattr(compiled, "widens", lambda kv_types: False)
        manifest = compile_to(fixtures.path("llama"), tmp_path / "rounded", options)
        assert manifest["verification"]["ok"] and "widened" not in manifest["verification"]["against"]
    with pytest.raises(VerificationError, match=r"prompt of 7 tokens: (logits differ by|token \d+ differs)"):
        compile_to(fixtures.path("llama"), tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


def test_a_selecting_models_numpy_check_keeps_the_f16_bound(tmp_path, monkeypatch):
    """gpt_oss's router (TopK) widens the bound only for runs in reduced arithmetic: kvc's numpy
    runtime computes in f32, and its check is what catches the passes' bugs. One layer's
    attention 1.3x too large shows NRMSE 0.026 there, under the 0.05 of bf16 blobs."""
    for branch in ("prefill", "generate-80", "generate-128"):
        _fault_in(monkeypatch, branch, ScaleLastAttention())
    with pytest.raises(VerificationError, match="the compiled pipeline does not reproduce"):
        compile_to(fixtures.path("gpt_oss"), tmp_path / "out",
                   CompileOptions(dataclasses.replace(SMALL, kv_precision="bf16")))
    assert not (tmp_path / "out").exists()


def test_the_manifest_is_the_same_bytes_whatever_blas_may_use(tmp_path):
    """The numpy check's numbers do not follow BLAS's threads (kvc.runtime.ops.products): it
    had one BLAS thread beside the CPU's device compile and two once that ended, and an AMD
    EPYC's compiles wrote other errors into manifest.json from run to run (a compile that took
    its blobs from the cache, another manifest than a fresh one). The same compile with BLAS
    allowed two threads and one (no device: the check alone, as with --device NPU before its
    compile): the same bytes."""
    from threadpoolctl import threadpool_info, threadpool_limits

    for threads in (2, 1):
        with threadpool_limits(limits=threads, user_api="blas"):
            compile_to(fixtures.path("llama"), tmp_path / f"cpu{threads}", CompileOptions(SMALL, devices=()))
            assert {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"} == {threads}  # given back
    assert (tmp_path / "cpu2" / "manifest.json").read_bytes() == (tmp_path / "cpu1" / "manifest.json").read_bytes()


def test_compile_verification_reads_the_prefill_past(tmp_path, monkeypatch):
    """The probes cross a chunk boundary: with the default-sized chunk of 64, prompts of 7 and
    33 tokens never ran a chunk over a real past, and a prefill that misread it was published."""
    _fault_in(monkeypatch, "prefill", HalvePastValues())
    options = StaticOptions(max_prompt_len=256, min_response_len=64, prefill_chunk_size=64)
    with pytest.raises(VerificationError, match="prompt of 73 tokens"):
        compile_to(fixtures.path("llama"), tmp_path / "out", CompileOptions(options))
    assert not (tmp_path / "out").exists()


def test_compile_verification_reads_the_bulk_prefill_past(tmp_path, monkeypatch):
    """With a bulk chunk B a probe of B + 9 tokens runs a chunk and then the bulk model over its
    rows: a bulk model that misreads its past is caught, which the probes of 7 and C + 9 tokens
    (a bulk call over an empty past at 25 tokens, chunks only at 7) never reach."""
    _fault_in(monkeypatch, "prefill-64", HalvePastValues())
    options = StaticOptions(max_prompt_len=256, min_response_len=64, prefill_chunk_size=(16, 64))
    with pytest.raises(VerificationError, match="prompt of 73 tokens"):
        compile_to(fixtures.path("llama"), tmp_path / "out", CompileOptions(options))
    assert not (tmp_path / "out").exists()


def test_the_first_chunks_probe_checks_the_chunk_over_a_past(tmp_path, monkeypatch):
    """With a first chunk F and a bulk chunk B (the CPU's default form) the probes from position
    0 are 7 and F + B + 9 tokens, no separate C + 9: the long one runs the chunk C over the
    first chunk's rows, so a chunk model that misreads its past is still caught there. The pad
    probes follow, each model with the fewest tokens the runtime gives it (the bulk chunk 33
    from P - 64, the first chunk 33, the chunk 1 from P - 16), then the far probes: the chunk's
    and the bulk chunk's last calls (each from P - size - C) and the generate variant's last
    two positions, decoded."""
    from kvc.verify.compiled import probe_cases

    options = StaticOptions(max_prompt_len=256, min_response_len=64, prefill_chunk_size=(16, 64), prefill_first=(64,))
    assert [(len(p.prompt), p.origin, p.decode) for p in probe_cases(options.lengths(), 1000)] == [
        (7, 0, False), (137, 0, False), (33, 192, False), (33, 0, False), (1, 240, False), (32, 224, False),
        (80, 176, False), (1, 318, True), (1, 318, True)]
    _fault_in(monkeypatch, "prefill", HalvePastValues())
    with pytest.raises(VerificationError, match="prompt of 137 tokens"):
        compile_to(fixtures.path("llama"), tmp_path / "out", CompileOptions(options))
    assert not (tmp_path / "out").exists()


def test_compile_verification_fills_the_smaller_variant(tmp_path, monkeypatch):
    """The switch probe starts a prompt of T1 - 2 tokens on the smallest variant T1 (80) and
    runs into the next: a fault in how that variant reads its last rows is caught, which the
    runtime's own choice (it starts a 64-token prompt on 128, keeping R free) never reaches."""
    _fault_in(monkeypatch, "generate-80", HalvePastValues(from_row=64))
    with pytest.raises(VerificationError, match="prompt of 64 tokens"):
        compile_to(fixtures.path("llama"), tmp_path / "out", CompileOptions(SMALL))
    assert not (tmp_path / "out").exists()


# The CPU's default form at bf16 for P 64, R 64 (chunk 16, first chunk 16) with one generate
# variant of 128: no probe from position 0 fills it, and the short probe runs 15 positions.
ONE_VARIANT = StaticOptions(max_prompt_len=64, min_response_len=64, prefill_chunk_size=16, prefill_first=(16,))


@dataclasses.dataclass(frozen=True)
class ClampPositions(Pass):
    """A fault at positions no prompt from position 0 reaches in a few steps: a generate model
    whose positions stop at `limit` (a rope or position table sized for P, not P + R)."""

    name: ClassVar[str] = "test-clamp-positions"
    limit: int = 63

    def run(self, model):
        import openvino.opset13 as ops

        (positions,) = [p for p in model.get_parameters() if p.output(0).get_any_name() == "position_ids"]
        _reroute(positions.output(0), lambda x: ops.minimum(x, ops.constant(np.int64(self.limit))))
        return PassResult(model, True)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compile_verification_reaches_the_last_positions(name, tmp_path, monkeypatch):
    """Positions P to P + R - 1 are reached by the far probes: without them the probes ran
    positions up to 26 of 128 (P 64, R 64) and generate models whose positions stopped at
    P - 1 were published (rotary llama; gpt2's learned position table)."""
    _fault_in(monkeypatch, "generate-128", ClampPositions())
    with pytest.raises(VerificationError, match="from position"):
        compile_to(fixtures.path(name), tmp_path / "out", CompileOptions(ONE_VARIANT))
    assert not (tmp_path / "out").exists()


def test_compile_verification_reads_a_variants_last_past_row(tmp_path, monkeypatch):
    """A generate variant that misreads the last row of its past (reached only by a prompt and
    generation that fill it) is caught by its far probe, decoded at its last two positions."""
    _fault_in(monkeypatch, "generate-128", HalvePastValues(from_row=126))
    with pytest.raises(VerificationError, match="prompt of 1 token from position 126"):
        compile_to(fixtures.path("llama"), tmp_path / "out", CompileOptions(ONE_VARIANT))
    assert not (tmp_path / "out").exists()


def test_a_sliding_window_gets_a_probe_past_it(tmp_path, monkeypatch):
    """A model whose config states a sliding window W below the capacity gets a probe whose last
    step attends past W (far probes start over empty rows, which no window drops): mistral's
    window of 32 compared one token short is caught by it."""
    import openvino.opset13 as ops

    from kvc.passes import mask_positions
    from kvc.verify.compiled import probe_cases

    lengths = ONE_VARIANT.lengths()
    plain = [(len(p.prompt), p.new_tokens) for p in probe_cases(lengths, 1000)]
    windowed = [(len(p.prompt), p.new_tokens) for p in probe_cases(lengths, 1000, window=32)]
    assert sorted(windowed) == sorted([*plain, (41, 2)])
    assert probe_cases(lengths, 1000, window=lengths.capacity) == probe_cases(lengths, 1000)

    real_range = mask_positions.ops.range

    class OffByOne:  # the past's positions numbered from 1: its window one token short
        def __getattr__(self, name):
            return getattr(ops, name)

        @staticmethod
        def range(start, stop, step, output_type="i64"):
            one = ops.constant(np.int64(1))
            return real_range(ops.add(start, one), ops.add(stop, one), step, output_type=output_type)

    monkeypatch.setattr(mask_positions, "ops", OffByOne())
    with pytest.raises(VerificationError, match="prompt of 41 tokens"):
        compile_to(fixtures.path("starcoder2"), tmp_path / "out", CompileOptions(ONE_VARIANT))
    assert not (tmp_path / "out").exists()


def test_gpt_neos_local_attention_window_gets_a_probe_past_it(tmp_path):
    """GPT-Neo states its local layers' window as `window_size` (with `attention_types`), not
    `sliding_window`: without reading it, no probe at P 64 attended past its 32 rows (the longest
    from position 0 had 25 tokens; far probes start over empty rows)."""
    from kvc.export.compile import model_window
    from kvc.ir.reader import resolve

    assert model_window(resolve(fixtures.path("gpt_neo")).root) == 32
    assert model_window(resolve(fixtures.path("mistral")).root) == 32
    assert model_window(resolve(fixtures.path("qwen2")).root) is None  # use_sliding_window: false
    assert model_window(resolve(fixtures.path("llama")).root) is None
    manifest = compile_to(fixtures.path("gpt_neo"), tmp_path / "out", CompileOptions(ONE_VARIANT))
    assert 41 in [r["prompt_tokens"] for r in manifest["verification"]["results"]]


def test_force_replaces_only_when_complete(tmp_path):
    out = tmp_path / "out"
    compile_to(fixtures.path("llama"), out, CompileOptions(SMALL, verify=False))
    before = (out / "manifest.json").read_text()
    with pytest.raises(UsageError, match="unknown device"):
        compile_to(fixtures.path("llama"), out, CompileOptions(SMALL, devices=("TPU",), force=True))
    assert (out / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_force_never_replaces_the_source_model(tmp_path):
    """`--force` replaces OUT whole: OUT naming the model's directory or a parent of it deleted
    the model it had just compiled. Refused up front (exit 2), the model untouched."""
    src = tmp_path / "models" / "llama"
    shutil.copytree(fixtures.path("llama"), src)
    files = sorted(p.name for p in src.iterdir())
    for out in (src, src.parent):
        with pytest.raises(UsageError, match="holds the source model .*choose another -o"):
            compile_to(src, out, CompileOptions(SMALL, verify=False, force=True))
    with pytest.raises(UsageError, match="openvino_model.xml is a file: kvc compile writes a directory"):
        compile_to(src, src / "openvino_model.xml", CompileOptions(SMALL, verify=False, force=True))
    link = tmp_path / "link"
    link.symlink_to(src.parent)
    result = kvc("compile", src / "openvino_model.xml", "-o", link, *CLI_SMALL, "--no-verify", "--force", code=2)
    assert "holds the source model" in result.output
    assert sorted(p.name for p in src.iterdir()) == files


@pytest.mark.parametrize("name, text", [("generation_config.json", '{"eos_token_id": 2'),
                                        ("config.json", "[1, 2]"), ("tokenizer.json", '{"model": "\xff')])
def test_a_config_file_that_is_not_a_json_object_is_refused_before_the_work(tmp_path, name, text):
    """A truncated generation_config.json was read as absent (no EOS for kvc run, no special
    ids in the probes), a broken config.json dropped the window probe: refused, exit 3, naming
    the file, and nothing written."""
    src = tmp_path / "m"
    shutil.copytree(fixtures.path("llama"), src)
    (src / name).write_text(text)
    out = kvc("compile", src, "-o", tmp_path / "out", *CLI_SMALL, code=3).output
    assert f"{src / name}: " in out and "[bad-config]" in out and "running passes" not in out, out
    assert not (tmp_path / "out").exists()


def test_force_replaces_a_symlink_at_out_but_never_the_working_directory(tmp_path, monkeypatch):
    """OUT a symlink: the link is replaced by the compile (what it pointed to is kept), not an
    internal error after publishing with `.out.old-PID` left. `-o .` crashed after the whole
    compile on the empty name; replacing the working directory would leave the shell in a
    deleted one, so it is refused up front (exit 2), as a parent of it is."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    out.symlink_to(target)
    kvc("compile", fixtures.path("llama"), "-o", out, *CLI_SMALL, "--no-verify", "--force")
    assert not out.is_symlink() and (out / "manifest.json").is_file()
    assert (target / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "out"]
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for out in (".", ".."):
        result = kvc("compile", fixtures.path("llama"), "-o", out, *CLI_SMALL, "--no-verify", "--force", code=2)
        assert "is the working directory or holds it" in result.output
    kvc("compile", fixtures.path("llama"), "-o", "sub", *CLI_SMALL, "--no-verify")  # a relative OUT below it
    assert (here / "sub" / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "here", "out"]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_leftovers_of_a_killed_compile_are_cleaned_and_said(tmp_path):
    out = tmp_path / "out"
    pid = _dead_pid()
    partial = tmp_path / f".out.partial-{pid}-abc123"
    (partial / "dumps").mkdir(parents=True)
    alive = tmp_path / f".out.partial-{os.getpid()}-xyz"  # a compile still running: left alone
    alive.mkdir()
    said = []
    compile_to(fixtures.path("llama"), out, CompileOptions(SMALL, verify=False), progress=said.append)
    assert not partial.exists() and alive.exists() and (out / "manifest.json").is_file()
    assert f"removed .out.partial-{pid}-abc123, left by an interrupted compile (process {pid})" in said


def test_a_result_being_replaced_when_killed_is_put_back(tmp_path):
    out = tmp_path / "out"
    compile_to(fixtures.path("llama"), out, CompileOptions(SMALL, verify=False))
    pid = _dead_pid()
    os.replace(out, tmp_path / f".out.old-{pid}")  # killed between the two renames of _publish
    said = []
    with pytest.raises(UsageError, match="exists; pass --force"):
        compile_to(fixtures.path("llama"), out, CompileOptions(SMALL, verify=False), progress=said.append)
    assert (out / "manifest.json").is_file() and not (tmp_path / f".out.old-{pid}").exists()
    assert any(line.startswith(f"restored {out} from .out.old-{pid}") for line in said)


def test_an_out_published_meanwhile_by_another_compile_is_kept(tmp_path, monkeypatch):
    import kvc.export.compile as compile_module

    out = tmp_path / "out"
    real = compile_module._compile_into

    def racing(*args):
        result = real(*args)
        out.mkdir()
        (out / "theirs").write_text("the other compile's result")
        return result

    monkeypatch.setattr(compile_module, "_compile_into", racing)
    with pytest.raises(UsageError, match="was created by another process during this compile; it was kept"):
        compile_to(fixtures.path("llama"), out, CompileOptions(SMALL, verify=False))
    assert [p.name for p in out.iterdir()] == ["theirs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_dumps_of_a_failed_compile_are_kept_where_said(tmp_path, monkeypatch):
    import kvc.verify.compiled as checks

    monkeypatch.setattr(checks, "verify_static", lambda *a, **k: {
        "against": "test", "ok": False, "results": [{"ok": False, "prompt_tokens": 7, "reason": "forced"}]})
    said = []
    with pytest.raises(VerificationError):
        compile_to(fixtures.path("llama"), tmp_path / "out", CompileOptions(SMALL, dumps=True), progress=said.append)
    kept = tmp_path / "out.failed-dumps"
    assert f"dumps of the failed compile: {kept}" in said
    assert (kept / "common" / "index.json").is_file() and not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.failed-dumps"]


_COMPILE = ("import sys; from kvc import fixtures; from kvc.plan import StaticOptions; "
            "from kvc.export.compile import compile_to, CompileOptions; "
            "compile_to(fixtures.path('qwen2'), sys.argv[1], CompileOptions(StaticOptions(64, 32), devices=('CPU',)))")


def test_same_input_gives_byte_identical_output(tmp_path):
    for d in ("a", "b"):
        subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path / d)], check=True)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_onnx_input_goes_through_the_same_pipeline(tmp_path):
    out = tmp_path / "onnx"
    compile_to(fixtures.path("gpt2", "onnx"), out, CompileOptions(SMALL))
    prompt = fixtures.goldens("gpt2")["prompts"][1]
    assert open_compiled(out, "openvino").generate(prompt["ids"], 24).tokens == prompt["tokens"]["onnxruntime"]


# NNCF formats whose decompression OpenVINO CPU rounds to f16 where NPUW (on its CPU backend)
# does not (kvc.runtime.interpreter, `decompression_nodes`): nf4's codes into an embedding's
# Gather, nvfp4's f32 scales. kvc's IR follows the CPU plugin, so the NPU blobs are judged
# against the IR decompressed as NPUW does (`npuw_reference`); judged exactly (f32 KV) against
# the CPU's, they were refused.
NPUW_DECOMPRESSES_UNROUNDED = ("llama_nf4_g16", "qwen2_nf4_g16", "llama_nvfp4")


@pytest.mark.parametrize("name", fixtures.COMPRESSED)
def test_compressed_weights_compile_verify_and_run_from_blobs(name, tmp_path):
    """optimum-cli --weight-format int8/int4/nf4/mxfp4/cb4 models (and NNCF's nvfp4 and fp8):
    compile (f32 KV and f32 CPU arithmetic: the exact check) publishes CPU and NPU blobs that
    reproduce the stateful model's goldens. (At the CPU plugin's default, bf16 with activations
    quantized for int8/int4 weights, tokens differ at small margins; that path is judged by the
    reduced-precision rule in compile.)"""
    from kvc.export.load import open_compiled

    from kvc.verify.compiled import npuw_reference

    out = tmp_path / "out"
    devices = ("CPU", "NPU")
    options = CompileOptions(StaticOptions(64, 64, kv_precision="f32"), devices=devices, inference_precision="f32")
    manifest = compile_to(fixtures.path(name), out, options)
    assert manifest["verification"]["ok"] and all(r["ok"] for r in manifest["blob_check"])
    # the NPU's own reference exists exactly where the CPU's decompression rounds
    assert (npuw_reference(out, manifest, [])() is not None) == (name in NPUW_DECOMPRESSES_UNROUNDED)
    golden = fixtures.goldens(name)
    for backend in ("openvino", "npu")[:len(devices)]:
        pipe = open_compiled(out, backend)
        for prompt in golden["prompts"]:
            assert pipe.generate(prompt["ids"], 24).tokens == prompt["tokens"]["openvino"], (backend, prompt["name"])


@pytest.mark.parametrize("name", ["llama", "bloom", "gpt_oss"])
def test_fp16_weights_compile_verify_and_run_from_blobs(name, tmp_path):
    """`optimum-cli --weight-format fp16` saves the weights as f16 Constants each read through
    a Convert to f32 (`ov.save_model(compress_to_fp16=True)`). Compiled exactly (f32 KV, f32 CPU
    arithmetic), CPU and NPU blobs reproduce that model's own tokens on OpenVINO CPU f32, and the
    published weights stay f16 (about half the fp32 fixture's)."""
    import shutil

    import openvino as ov

    from kvc.export.load import open_compiled
    from kvc.runtime.generate import greedy
    from kvc.runtime.session import open_session

    source = tmp_path / "fp16"
    shutil.copytree(fixtures.path(name), source, ignore=shutil.ignore_patterns("openvino_model.*"))
    ov.save_model(ov.Core().read_model(fixtures.path(name) / "openvino_model.xml"), source / "openvino_model.xml",
                  compress_to_fp16=True)
    model = ov.Core().read_model(source / "openvino_model.xml")
    assert any(op.get_type_name() == "Constant" and op.get_output_element_type(0) == ov.Type.f16
               for op in model.get_ops())
    out = tmp_path / "out"
    manifest = compile_to(source, out, CompileOptions(StaticOptions(64, 64, kv_precision="f32"),
                                                      devices=("CPU", "NPU"), inference_precision="f32"))
    assert manifest["verification"]["ok"] and all(r["ok"] for r in manifest["blob_check"])
    fp32 = (fixtures.path(name) / "openvino_model.bin").stat().st_size
    assert (out / "weights.bin").stat().st_size < 0.6 * fp32
    reference = open_session(source, "openvino")
    for backend in ("openvino", "npu"):
        pipe = open_compiled(out, backend)
        for prompt in fixtures.goldens(name)["prompts"]:
            want = greedy(reference, prompt["ids"], 16).tokens
            assert pipe.generate(prompt["ids"], 16).tokens == want, (backend, prompt["name"])


def test_a_mixture_of_experts_compiles_with_the_defaults(tmp_path):
    """qwen3_moe with kvc compile's defaults: a first chunk of dynamic rows made the CPU plugin
    export a blob it cannot import (its internal GatherMatmul), exit 5 on every default
    compile; a model that selects (a TopK router) gets static first chunks instead. (f32 blobs,
    the defaults of a host without bf16: at bf16 every first chunk is static.)"""
    f32 = (*CLI_SMALL, "--inference-precision", "f32")
    out = tmp_path / "out"
    kvc("compile", fixtures.path("qwen3_moe"), "-o", out, *f32)
    assert read_manifest(out)["plan"]["lengths"].get("prefill_first_rows", "static") == "static"
    dense = tmp_path / "dense"
    kvc("compile", fixtures.path("llama"), "-o", dense, *f32, "--no-verify")
    assert read_manifest(dense)["plan"]["lengths"]["prefill_first_rows"] == "dynamic"
    # Asked for anyway, the plugin's import failure comes with what to do (OpenVINO 2026.4).
    result = kvc("compile", fixtures.path("qwen3_moe"), "-o", tmp_path / "asked", *f32,
                 "--prefill-first-rows", "dynamic", code=5)
    assert "Cannot create GatherMatmul layer" in result.output
    assert "compile with --prefill-first-rows static (auto is static for a model with a TopK router)" in result.output


def test_a_chain_the_cpu_plugin_cannot_import_back_is_compiled_apart(tmp_path, monkeypatch):
    """OpenVINO 2026.4.1's CPU plugin compiles Qwen3-MoE and AFMoE as exported under
    transformers 4.57 into its internal GatherMatmul and cannot import that op back from inside
    the If chain of prefill models ("Cannot create GatherMatmul layer ... from unsupported
    opset: extension"), though it imports each model compiled alone: the default CPU compile
    stopped at exit 5. The compile now compiles them apart and checks them again. (No fixture
    makes the plugin do it: the zoo's qwen3_moe, exported under transformers 5, imports; the
    chain blob's import is made to fail as the plugin's does.)"""
    import kvc.export.load as load

    real, refused = load._import_core, []

    class Refusing:
        def __init__(self, core):
            self.core = core

        def import_model(self, stream, device, config):
            compiled = self.core.import_model(stream, device, config)
            if any(name.startswith("kvc.select.") for i in compiled.inputs for name in i.get_names()):  # a chain
                refused.append(device)
                raise RuntimeError("Exception from src/plugins/intel_cpu/src/node.cpp:1:\nCannot create GatherMatmul "
                                   "layer MatMul#9f2bc3e7 id:102 from unsupported opset: extension")
            return compiled

    monkeypatch.setattr(load, "_import_core", lambda config: Refusing(real(config)))
    out = tmp_path / "out"
    chained = dataclasses.replace(SMALL, prefill_chunk_size=16, prefill_first=(32,))  # prefill + first-32
    compile_to(fixtures.path("llama"), out, CompileOptions(chained))
    assert refused == ["CPU"]  # once: then every model has a blob of its own
    blobs = {name: m["blobs"]["CPU"] for name, m in read_manifest(out)["models"].items()}
    assert len(blobs) > 2 and not any("branches" in b for b in blobs.values())
    assert len({b["file"] for b in blobs.values()}) == len(blobs)
    assert sorted(p.name for p in out.glob("*.blob")) == sorted(b["file"] for b in blobs.values())
    monkeypatch.setattr(load, "_import_core", real)
    result = kvc("verify", out)
    assert "verification: OK" in result.output
    prompt = fixtures.goldens("llama")["prompts"][0]
    pipe = open_compiled(out, "openvino")
    assert pipe.generate(prompt["ids"], 8).tokens == prompt["tokens"]["openvino"][:8]


@pytest.mark.parametrize("device", ["CPU", "NPU"])
def test_llama4s_attention_temperature_reads_positions(tmp_path, device):
    """Llama 4 scales its NoPE layer's queries by log1p(floor((cache_position + 1) / floor_scale))
    * attn_scale + 1, reading cache_position, slots, beside its position_ids. The fixture's
    floor_scale is Scout's 8192 (a scale of 1 at its lengths); with 8 the temperature moves
    every 8 positions, and every compile was refused (CPU: "prompt of 7 tokens: token 0
    differs"; NPU: "prompt of 127 tokens: logits differ by 0.0359") while the static models
    read slots (mask-positions/slot-positions now gives them positions, and the compile's
    references of a prompt from a position run over that many masked rows, so theirs are
    positions too)."""
    source = tmp_path / "llama4_floor8"
    shutil.copytree(fixtures.path("llama4"), source)
    model = ov.Core().read_model(fixtures.path("llama4") / "openvino_model.xml")  # not the copy it overwrites
    (scale,) = [n for n in model.get_ordered_ops() if n.get_type_name() == "Constant"
                and n.get_output_size() == 1 and n.get_data().size == 1 and float(n.get_data().reshape(-1)[0]) == 8192.0]
    scale.output(0).replace(ops.constant(np.array([8.0], np.float32)).output(0))
    ov.save_model(model, source / "openvino_model.xml", compress_to_fp16=False)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "floor_scale": 8}))
    out = tmp_path / "out"
    kvc("compile", source, "-o", out, "--device", device, *CLI_SMALL)  # exit 0: verified
    assert "verification: OK" in kvc("verify", out).output


def test_a_source_that_selects_is_found_in_ir_and_onnx(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from kvc.export.compile import source_selects

    assert source_selects(fixtures.path("qwen3_moe")) and not source_selects(fixtures.path("llama"))
    llama_onnx = fixtures.path("llama").parent / "onnx" / "model.onnx"
    assert llama_onnx.exists() and not source_selects(llama_onnx)
    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=-1)], "router",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 2]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [1, 2])],
        [helper.make_tensor("k", TensorProto.INT64, [1], [2])])
    onnx.save(helper.make_model(graph), tmp_path / "router.onnx")
    assert source_selects(tmp_path / "router.onnx")


def test_a_capacity_past_the_models_max_positions_is_said(tmp_path):
    """mpt's ALiBi table stops at max_seq_len = 256: the pass failure says why, and what to do;
    gpt2's learned positions compile, with a warning."""
    from kvc.passes import PassFailure

    beyond = StaticOptions(max_prompt_len=256, min_response_len=64)
    with pytest.raises(PassFailure) as info:
        compile_to(fixtures.path("mpt"), tmp_path / "mpt", CompileOptions(beyond, devices=(), verify=False))
    text = str(info.value)
    assert text.startswith(str(fixtures.path("mpt") / "openvino_model.xml") + ": pass static-shape failed")
    assert "note: the capacity P + R = 320 exceeds the model's max_seq_len = 256 (config.json); " \
           "lower --max-prompt-len/--min-response-len to fit" in text
    said = []
    compile_to(fixtures.path("gpt2"), tmp_path / "gpt2", CompileOptions(beyond, devices=(), verify=False),
               progress=said.append)
    assert "warning: the capacity P + R = 320 exceeds the model's n_positions = 256 (config.json); positions " \
           "past it are outside what the model was built for" in said
    said.clear()
    compile_to(fixtures.path("gpt2"), tmp_path / "gpt2-fits", CompileOptions(SMALL, devices=(), verify=False),
               progress=said.append)
    assert not [s for s in said if "warning" in s]


def test_a_probe_past_the_models_position_table_says_why(tmp_path):
    """gptj's rotary table stops at n_positions = 256: asked for P 1024, the check's 521-token
    probe reads past it on kvc's interpreter, and the error says what the capacity exceeds."""
    from kvc.runtime.interpreter import EvaluationError

    options = StaticOptions(max_prompt_len=1024, min_response_len=64, prefill_chunk_size=(16, 512))
    with pytest.raises(EvaluationError) as info:
        compile_to(fixtures.path("gptj"), tmp_path / "gptj", CompileOptions(options, devices=()))
    assert re.search(r"IndexError: index \d+ is out of bounds", str(info.value))
    assert str(info.value).endswith("note: the capacity P + R = 1088 exceeds the model's n_positions = 256 "
                                    "(config.json); lower --max-prompt-len/--min-response-len to fit")
    assert not (tmp_path / "gptj").exists()


@pytest.mark.parametrize("precision", ["auto", "f32"])
def test_cpu_blobs_run_at_the_precision_a_deployment_gets(tmp_path, precision):
    """auto: the CPU plugin's own default (bf16 on hosts with AVX512_BF16 or AMX, else f32),
    recorded as the compiled model reports it and restored at import; f32: exact, judged so."""
    from kvc.export.load import open_compiled
    from kvc.ir.reader import core

    options = StaticOptions(64, 64, kv_precision="f32")
    manifest = compile_to(fixtures.path("llama"), tmp_path / "out", CompileOptions(options, inference_precision=precision))
    expected = core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name() if precision == "auto" else "f32"
    for entry in manifest["models"].values():
        assert entry["blobs"]["CPU"]["import_config"]["INFERENCE_PRECISION_HINT"] == expected
    exact = "logits within" in manifest["blob_check"][0]["reason"]
    assert exact == (expected == "f32"), manifest["blob_check"][0]["reason"]
    got = open_compiled(tmp_path / "out", "openvino").generate(fixtures.goldens("llama")["prompts"][0]["ids"], 4)
    assert got.tokens == fixtures.goldens("llama")["prompts"][0]["tokens"]["openvino"][:4]


def test_default_lengths_follow_the_models_positions(tmp_path):
    """Without --max-prompt-len/--min-response-len the capacity fits what config.json states:
    mpt (max_seq_len 256) compiles with the defaults, P lowered to 128 and the change recorded."""
    said = []
    manifest = compile_to(fixtures.path("mpt"), tmp_path / "mpt", CompileOptions(devices=(), verify=False),
                          progress=said.append)
    lengths = manifest["plan"]["lengths"]
    assert (lengths["max_prompt_len"], lengths["min_response_len"], lengths["capacity"]) == (128, 128, 256)
    assert any("lowered to 128 so that P + R fits the model's 256 positions" in a for a in lengths["adjustments"])
    assert manifest["plan"]["options"]["max_positions"] == 256
    assert not [s for s in said if "warning" in s]


def _resident_kib(path, ranges) -> int:
    """Resident KiB of this process's mappings at `ranges` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = (start, end) in ranges
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


NUMPY_OPEN = """
import gc, json, sys
from kvc.export.load import open_compiled
out, ids = sys.argv[1], json.loads(sys.argv[2])
pipe = open_compiled(out, "numpy")
gc.collect()  # nothing but the sessions holds the mapping now
tokens = pipe.generate(ids, 8).tokens
rss, maps = 0, 0
with open("/proc/self/smaps") as f:
    inside = False
    for line in f:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            inside = line.rstrip().endswith("/weights.bin")
            maps += inside
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1])
print(json.dumps({"tokens": tokens, "rss_kib": rss, "mappings": maps}))
"""


def test_the_numpy_runtime_maps_the_weights_once_for_every_model(tmp_path):
    """kvc's numpy runtime reads every model of a directory over one mapping of weights.bin
    (ir.reader.map_weights): a mapping per model counted the pages each model touched again
    (three models of the 250M Llama held 2.6 GB resident, 0.97 GB over one mapping). The
    mapping lives as long as the sessions whose constants point into it: dropped with the
    function that made it, the next call crashed. In a child process, so that a crash fails
    the test and the mappings are the open's alone."""
    out = tmp_path / "out"
    options = dataclasses.replace(SMALL, prefill_chunk_size=(16, 32))  # prefill, prefill-32, generate-80, generate-128
    compile_to(fixtures.path("llama"), out, CompileOptions(options, devices=(), verify=False))
    golden = fixtures.goldens("llama")["prompts"][2]  # 54 tokens: a chunk and bulk calls
    proc = subprocess.run([sys.executable, "-c", NUMPY_OPEN, str(out), json.dumps(golden["ids"])],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokens"] == golden["tokens"]["openvino"][:8]
    size_kib = (out / "weights.bin").stat().st_size / 1024
    assert got["mappings"] == 1 and got["rss_kib"] <= size_kib + 8, got


def test_the_compile_reference_leaves_the_sources_weights_to_the_page_cache(tmp_path, monkeypatch):
    """The check's reference (the source on OpenVINO CPU f32) drops what its compile read of the
    source's weights file: the compile's peak was the reference's, with the file resident in
    its mapping beside the plugin's own copy (2.5 GB for the 250M Llama, 1.8 without)."""
    import kvc.export.mapped as mapped
    from kvc.export.compile import reference_session

    source = tmp_path / "llama"
    shutil.copytree(fixtures.path("llama"), source)  # a file no other test maps
    weights = source / "openvino_model.bin"
    size_kib = weights.stat().st_size // 1024

    def resident():
        before = mapped.shared_readonly_mappings(weights)
        session = reference_session(source)
        return session, _resident_kib(weights, mapped.shared_readonly_mappings(weights) - before)

    released, kib = resident()
    assert kib < 0.1 * size_kib
    monkeypatch.setattr(mapped, "_madvise", None)
    kept, kib_kept = resident()
    assert kib_kept > 0.9 * size_kib
    prompt = fixtures.goldens("llama")["prompts"][1]
    from kvc.runtime.generate import greedy

    assert greedy(released, prompt["ids"], 8).tokens == greedy(kept, prompt["ids"], 8).tokens \
        == prompt["tokens"]["openvino"][:8]


def test_opened_cpu_blobs_leave_weights_file_pages_to_the_page_cache(compiled, monkeypatch):
    """Each CPU import maps weights.bin and packs the weights into memory of its own; kvc drops
    the mapping's pages after the import (export/mapped.py), so the process does not keep the
    file resident once per model. Without the release the same mappings hold every page. (NPUW's
    imports keep no mapping of the file.)"""
    import kvc.export.mapped as mapped

    weights = compiled / "weights.bin"
    size_kib = weights.stat().st_size // 1024
    prompt = fixtures.goldens("llama")["prompts"][2]

    def opened():
        before = mapped.shared_readonly_mappings(weights)
        pipe = open_compiled(compiled, "openvino")
        new = mapped.shared_readonly_mappings(weights) - before
        assert new, "the import maps weights.bin"
        return pipe, _resident_kib(weights, new)

    released, resident = opened()
    assert resident < 0.1 * size_kib
    monkeypatch.setattr(mapped, "_madvise", None)
    unreleased, resident_unreleased = opened()
    assert resident_unreleased > 0.9 * size_kib * 2  # prefill and generate each keep the whole file
    a, b = released.generate(prompt["ids"], 24), unreleased.generate(prompt["ids"], 24)
    assert a.tokens == b.tokens == prompt["tokens"]["openvino"]
    np.testing.assert_array_equal(np.stack(a.logits), np.stack(b.logits))


def test_an_open_pages_out_weights_file_behind_its_first_import_and_during_every_other(compiled, monkeypatch):
    """The first import reads weights.bin whole before it packs and is swept behind its packing
    where its blob computes below f32 (swept from the start, it would read the file from disk
    once per If body and again to pack), not at all at f32 (`first_sweep`); every later import,
    when packed weights are already resident, is swept from the start."""
    import contextlib

    import kvc.export.load as load

    sweeps = []
    real = load.pages_released

    @contextlib.contextmanager
    def recorded(path, *, sweep="all"):
        sweeps.append(sweep)
        with real(path, sweep=sweep):
            yield

    monkeypatch.setattr(load, "pages_released", recorded)
    pipe = open_compiled(compiled, "openvino")
    first = read_manifest(compiled)["models"]["prefill"]["blobs"]["CPU"]["import_config"]
    assert sweeps == [load.first_sweep(first)] + ["all"] * len(pipe.generate_sessions)  # generate, then prefill
    assert load.first_sweep(first) == ("none" if first["INFERENCE_PRECISION_HINT"] == "f32" else "behind")
    assert load.first_sweep({**first, "INFERENCE_PRECISION_HINT": "bf16"}) == "behind"
    assert load.first_sweep({}) == "behind"  # NPUW's, or no hint recorded
    prompt = fixtures.goldens("llama")["prompts"][2]
    assert pipe.generate(prompt["ids"], 24).tokens == prompt["tokens"]["openvino"]
    # The compile's blob check opens lazily, holding few blobs at once: never swept.
    sweeps.clear()
    lazy = load.pipeline_from(compiled, load.read_manifest(compiled), "openvino", lazy=True)
    assert lazy.generate(prompt["ids"], 24).tokens == prompt["tokens"]["openvino"]
    assert sweeps and set(sweeps) == {"none"}  # the prefill and the generate variants it ran
    # One that serves (compile_and_open's check, keeping what it imports) is swept as an open, in
    # the order its imports happen: the prefill blob as the first import, the generate blob after
    # (unswept, the 250M Llama's f32 compile_and_open peaked at 3745 MB against 2691).
    sweeps.clear()
    serving = load.pipeline_from(compiled, load.read_manifest(compiled), "openvino", lazy=True, serves=True)
    assert serving.generate(prompt["ids"], 24).tokens == prompt["tokens"]["openvino"]
    assert sweeps == [load.first_sweep(first), "all"]  # the prefill's blob, then the generate variant it ran


def test_an_import_in_progress_never_holds_the_whole_weights_file(tmp_path, monkeypatch):
    """While an import reads its mapping of weights.bin, kvc pages out what it has read (export/
    mapped.py): the block never holds the whole file resident, and pages read again come back
    with the same bytes. Without it the block holds every page it read (the second model's import
    held all 938 MB of the bench model's file beside the first model's packed weights)."""
    import mmap

    import kvc.export.mapped as mapped

    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())  # clean pages, as a published directory's are
    size_kib, page = data.size // 1024, mmap.PAGESIZE

    def read_like_an_import() -> tuple[int, list[int], int]:
        """Map the file as the plugin does (read-only, shared), read it in 16 pieces over about
        half a second; the peak resident KiB of the mapping, each piece's sum, a second read's."""
        peak, sums = 0, []
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = np.frombuffer(mm, np.uint8)
            ranges = mapped.shared_readonly_mappings(path)
            assert ranges, "the test's mapping is found as an import's would be"
            for i in range(16):
                sums.append(int(view[i << 22:(i + 1) << 22][::page].sum(dtype=np.int64)))
                time.sleep(3 * mapped.SWEEP_SECONDS / 4)
                peak = max(peak, _resident_kib(path, ranges))
            again = int(view[::page].sum(dtype=np.int64))
            del view
        return peak, sums, again

    with open(path, "rb") as f, mmap.mmap(f.fileno(), page, access=mmap.ACCESS_READ):
        if mapped._madvise is None or mapped._madvise(mapped.shared_readonly_mappings(path).pop()[0], page,
                                                       mapped._MADV_PAGEOUT) != 0:
            pytest.skip("this kernel has no MADV_PAGEOUT (Linux 5.4): kvc keeps the pages until the import ends")
    expected = [int(data[i << 22:(i + 1) << 22][::page].sum(dtype=np.int64)) for i in range(16)]
    with mapped.pages_released(path):
        peak, sums, again = read_like_an_import()
    assert sums == expected and again == int(data[::page].sum(dtype=np.int64))
    assert peak < 0.5 * size_kib, f"{peak} KiB of {size_kib} resident during the read"
    monkeypatch.setattr(mapped, "_madvise", None)
    with mapped.pages_released(path):
        unswept, _, _ = read_like_an_import()
    assert unswept > 0.9 * size_kib


def _in_page_cache(address: int, length: int) -> np.ndarray:
    """Which pages of [address, address + length) are in memory (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    vec = np.zeros(-(-length // mmap.PAGESIZE), np.uint8)
    assert libc.mincore(address, length, vec.ctypes.data) == 0, ctypes.get_errno()
    return vec & 1 == 1


def test_an_opens_first_import_pages_out_only_what_its_packing_has_passed(tmp_path, monkeypatch):
    """An open's first import reads the whole weights file (the CPU plugin scans every
    constant) before it packs, then packs in the file's order: swept "behind", nothing is paged
    out while it only reads, nor a page its packing has yet to read (that page would be read
    from disk again), and what the packing has passed (its anonymous memory's growth, less the
    margin) is paged out as it goes. Swept from the start, the scan's pages are gone before the
    packing reads them; never swept, the whole file stays resident to the end."""
    import mmap

    import kvc.export.mapped as mapped

    monkeypatch.setattr(mapped, "BEHIND_MARGIN", 8 << 20)
    data = np.random.default_rng(2).integers(0, 256, 64 << 20, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    page, piece, size_kib = mmap.PAGESIZE, 4 << 20, data.size // 1024

    def scan_then_pack() -> tuple[int, int, int, list[int]]:
        """Read the file whole, wait three sweeps, then 'pack' it: 16 pieces in order, each
        read and answered with as much touched anonymous memory. Returns the mapping's resident
        KiB after the scan and at the end, the fewest not-yet-packed bytes found still in
        memory (of those that should be), and each piece's sum as read."""
        packed, sums, ahead_missing = [], [], 0
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = np.frombuffer(mm, np.uint8)
            (start, _), = mapped.shared_readonly_mappings(path)
            ranges = {(start, start + len(mm))}
            view[::page].sum(dtype=np.int64)
            time.sleep(3 * mapped.SWEEP_SECONDS)
            after_scan = _resident_kib(path, ranges)
            for i in range(16):
                ahead = _in_page_cache(start + i * piece, len(mm) - i * piece)
                ahead_missing += int((~ahead).sum())
                sums.append(int(view[i * piece:(i + 1) * piece][::page].sum(dtype=np.int64)))
                packed.append(np.ones(piece, np.uint8))
                time.sleep(3 * mapped.SWEEP_SECONDS / 4)
            time.sleep(3 * mapped.SWEEP_SECONDS)
            at_end = _resident_kib(path, ranges)
            del view
        return after_scan, at_end, ahead_missing, sums

    expected = [int(data[i * piece:(i + 1) * piece][::page].sum(dtype=np.int64)) for i in range(16)]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), page, access=mmap.ACCESS_READ):
        if mapped._madvise is None or mapped._madvise(mapped.shared_readonly_mappings(path).pop()[0], page,
                                                       mapped._MADV_PAGEOUT) != 0:
            pytest.skip("this kernel has no MADV_PAGEOUT (Linux 5.4): kvc keeps the pages until the import ends")
    with mapped.pages_released(path, sweep="behind"):
        after_scan, at_end, ahead_missing, sums = scan_then_pack()
    assert sums == expected
    assert after_scan > 0.9 * size_kib, "nothing is paged out before the packing begins"
    assert ahead_missing == 0, f"{ahead_missing} pages the packing had yet to read were paged out"
    assert at_end < 0.3 * size_kib, f"{at_end} KiB of {size_kib} still resident after the packing"
    with mapped.pages_released(path, sweep="all"):
        after_scan, _, ahead_missing, sums = scan_then_pack()
    assert sums == expected and after_scan < 0.5 * size_kib and ahead_missing > 0
    with mapped.pages_released(path, sweep="none"):
        _, at_end, _, sums = scan_then_pack()
    assert sums == expected and at_end > 0.9 * size_kib
    with pytest.raises(ValueError, match="sweep must be one of"):
        with mapped.pages_released(path, sweep=True):
            pass


def _random_weights(tmp_path, mib: int = 64):
    data = np.random.default_rng(1).integers(0, 256, mib << 20, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    return path, data


def test_a_device_compile_drops_the_weights_pages_it_has_read_and_keeps_their_bytes(tmp_path, monkeypatch):
    """A device compile reads weights.bin over kvc's own mapping, whose pages kvc drops as the
    compile reads them (export/mapped.py, HeldPages): the NPU compile of the bench model held
    the whole file beside NPUW's copy of it (3065 MB, 2150 with the pages dropped). Read
    again, every page has the file's bytes. Without the sweep the mapping holds all it read."""
    import kvc.export.mapped as mapped
    from kvc.ir.reader import map_weights

    path, data = _random_weights(tmp_path)
    size_kib, page = data.size // 1024, os.sysconf("SC_PAGESIZE")
    expected = [int(data[i << 22:(i + 1) << 22][::page].sum(dtype=np.int64)) for i in range(16)]

    def read_like_a_compile():
        weights = map_weights(path)
        view = weights.data
        start = view.ctypes.data
        ranges = {(start, start + -(-view.nbytes // page) * page)}
        peak, sums = 0, []
        with mapped.HeldPages(weights, path):
            for i in range(16):
                sums.append(int(view[i << 22:(i + 1) << 22][::page].sum(dtype=np.int64)))
                time.sleep(3 * mapped.SWEEP_SECONDS / 4)
                peak = max(peak, _resident_kib(path, ranges))
            again = int(view[::page].sum(dtype=np.int64))
        return peak, sums, again, _resident_kib(path, ranges)

    peak, sums, again, after = read_like_a_compile()
    assert sums == expected and again == int(data[::page].sum(dtype=np.int64))
    assert peak < 0.5 * size_kib and after < 0.01 * size_kib, (peak, after, size_kib)
    monkeypatch.setattr(mapped, "_madvise", None)
    unswept, _, _, kept = read_like_a_compile()
    assert unswept > 0.9 * size_kib and kept > 0.9 * size_kib


HELD_WRITE = """
import sys
from kvc.export.mapped import HeldPages
from kvc.ir.reader import map_weights
weights = map_weights(sys.argv[1])
with HeldPages(weights, sys.argv[1]):
    weights.data[4096] ^= 0xFF
print("written")
"""


def test_trim_heap_gives_the_c_heaps_free_memory_back():
    """Memory freed inside the C heap (below its top, so malloc cannot shrink it) stays in
    the process's RSS until trim_heap, which compile_and_open calls before it serves."""
    script = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) >> 10
blocks = [libc.malloc(64 << 10) for _ in range(4000)]  # 250 MB, each below the mmap threshold
for block in blocks:
    ctypes.memset(block, 1, 64 << 10)
pin = libc.malloc(64 << 10)  # above them
for block in blocks:
    libc.free(block)
before = rss()
from kvc.export.mapped import trim_heap
trim_heap()
print(before, rss())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, after = map(int, done.stdout.split())
    assert before - after > 200, (before, after)


@pytest.mark.parametrize("backend", ["openvino", "npu"])
def test_an_opened_blob_trims_the_heap_after_its_first_inference(compiled, backend, monkeypatch):
    """NPUW frees what its import copied at a compiled model's first inference; the heap is
    trimmed then, once per imported model (the 250M Llama's NPU open held 2038 MB after a
    prompt, 1282 trimmed), not on every inference, and not for models run from their IR. An
    NPU open runs that first inference of each blob but the last imported as it imports it
    (`_first_inference`: both generate variants here); the CPU's wait for the first prompt."""
    import kvc.export.load as load

    trims = []
    monkeypatch.setattr(load, "trim_heap", lambda: trims.append(1))
    pipe = open_compiled(compiled, backend)
    assert len(pipe.generate_sessions) == 2
    assert len(trims) == (2 if backend == "npu" else 0)
    pipe.generate([1, 2, 3], 4)
    ran = 3 if backend == "npu" else 2  # the prefill model and the one generate variant it ran (of two)
    assert len(trims) == ran
    pipe.generate([4, 5, 6, 7], 4)
    assert len(trims) == ran
    open_compiled(compiled, backend, from_ir=True).generate([1, 2, 3], 4)
    assert len(trims) == ran


def test_held_weights_cannot_be_written_so_dropping_them_loses_nothing(tmp_path):
    """The mapping is copy-on-write (OpenVINO shares only a writable buffer); a page written in
    it would be private, and dropping it would silently undo the write. HeldPages makes it
    read-only first, so a write faults instead (in a child: the fault kills the process)."""
    path, _ = _random_weights(tmp_path, 1)
    proc = subprocess.run([sys.executable, "-c", HELD_WRITE, str(path)], capture_output=True, text=True)
    assert proc.returncode == -11 and "written" not in proc.stdout, (proc.returncode, proc.stderr[-500:])


def test_memory_that_is_not_the_weights_files_mapping_is_never_dropped(tmp_path):
    """Dropping pages is lossless only on the file's own mapping: a buffer OpenVINO copied the
    weights into (anonymous memory, page-aligned like a mapping) would lose its contents. Such a
    tensor is left alone, and stays writable."""
    import mmap

    import openvino as ov

    from kvc.export.mapped import HeldPages

    path, data = _random_weights(tmp_path, 1)
    anonymous = mmap.mmap(-1, data.size)
    copy = np.frombuffer(anonymous, np.uint8)
    copy[:] = data
    tensor = ov.Tensor(copy, shared_memory=True)
    assert tensor.data.ctypes.data % mmap.PAGESIZE == 0
    with HeldPages(tensor, path) as pages:
        pages.drop()
        time.sleep(0.1)
    np.testing.assert_array_equal(copy, data)
    copy[0] ^= 0xFF  # still writable
    del copy, tensor


def test_until_idle_waits_for_the_plugins_other_threads(tmp_path):
    """NPUW copies the weights into its bank on a thread of its own after compile_model returns,
    and export_model waits for it holding the GIL (no sweep runs then): HeldPages.until_idle
    returns once the process's other threads stop using the CPU, at once when they are idle."""
    import threading

    from kvc.export.mapped import HeldPages
    from kvc.ir.reader import map_weights

    path, _ = _random_weights(tmp_path, 1)
    pages = HeldPages(map_weights(path), path)

    def busy(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(1000))

    worker = threading.Thread(target=busy, args=(0.6,))
    started = time.monotonic()
    worker.start()
    pages.until_idle()
    waited = time.monotonic() - started
    worker.join()
    started = time.monotonic()
    pages.until_idle()
    idle = time.monotonic() - started
    assert waited > 0.4 and idle < 0.3, (waited, idle)


def test_background_hashes_rehash_a_file_changed_after_its_hash_started(tmp_path):
    """The manifest's hashes are taken while the compile goes on; a file rewritten after its
    hash started must not be recorded with the old content's hash: rewritten in place with the
    same size and its mtime put back, or replaced by another file."""
    import hashlib
    import time

    from kvc.export.manifest import BackgroundHashes

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a.write_bytes(b"first" * 1000)
    b.write_bytes(b"kept")
    c.write_bytes(b"old")
    with BackgroundHashes() as hashes:
        for path in (a, b, c):
            hashes.start(path)
        assert hashes.entry(a)["sha256"] == hashlib.sha256(b"first" * 1000).hexdigest()
        st = a.stat()
        time.sleep(0.01)
        a.write_bytes(b"FIRST" * 1000)  # same size
        os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
        replacement = tmp_path / "c.new"
        replacement.write_bytes(b"new")
        os.utime(replacement, ns=(c.stat().st_atime_ns, c.stat().st_mtime_ns))
        os.replace(replacement, c)
        assert hashes.entry(a) == {"bytes": 5000, "sha256": hashlib.sha256(b"FIRST" * 1000).hexdigest()}
        assert hashes.entry(c) == {"bytes": 3, "sha256": hashlib.sha256(b"new").hexdigest()}
        assert hashes.entry(b) == {"bytes": 4, "sha256": hashlib.sha256(b"kept").hexdigest()}
        assert hashes.entry(tmp_path / "a") == hashes.entry(a)


def test_range_hashes_for_the_blob_cache(tmp_path):
    """The blob cache's keys hash each constant's bytes (on a second thread beside the
    manifest's hash of weights.bin): overlapping, empty and final ranges agree with hashing
    each slice alone; a range past the end is refused; a file changed since is hashed again."""
    import hashlib

    from kvc.export.manifest import BackgroundHashes, sha256_ranges

    data = np.random.default_rng(0).integers(0, 256, 10_000, np.uint8).tobytes()
    path = tmp_path / "w.bin"
    path.write_bytes(data)
    ranges = [(0, 10), (5, 3000), (4090, 20), (9000, 1000), (9999, 1), (100, 0), (10_000, 0)]
    expected = {(o, n): hashlib.sha256(data[o:o + n]).hexdigest() for o, n in ranges}
    assert sha256_ranges(path, ranges, chunk=4096) == expected
    with pytest.raises(ValueError, match="past the end of the file"):
        sha256_ranges(path, [(9990, 20)])
    with BackgroundHashes() as hashes:
        hashes.start(path, ranges)
        assert hashes.range_digests(path, ranges) == expected
        assert hashes.entry(path)["sha256"] == hashlib.sha256(data).hexdigest()
        path.write_bytes(data[::-1])
        assert hashes.range_digests(path, [(0, 10)]) == {(0, 10): hashlib.sha256(data[::-1][:10]).hexdigest()}


def test_compile_verification_runs_every_generate_variant(tmp_path, monkeypatch):
    """With four variants (80, 96, 112 and the capacity's 128) the probes start on 128 (P - 1
    tokens and R), switch from 80 to 96, and decode 7 tokens from position 0 on 80 (the
    generate models' first positions); the one none of them reaches, 112, is run too, by its
    far probe (before them, the short prompt started on it, one step), so a fault there is
    caught before anything is published (it was not)."""
    from kvc.verify.compiled import probe_cases

    _fault_in(monkeypatch, "generate-112", HalvePastValues())
    options = dataclasses.replace(SMALL, variants=(80, 96, 112))
    assert [(p.start, p.origin, p.filled) for p in probe_cases(options.lengths(), 1000) if p.decode] == [
        (80, 0, False), *((size, size - 2, filled) for size in (80, 96, 112, 128) for filled in (False, True))]
    with pytest.raises(VerificationError, match="prompt of 1 token from position 110: "):
        compile_to(fixtures.path("llama"), tmp_path / "out", CompileOptions(options))
    assert not (tmp_path / "out").exists()


def test_the_library_builds_what_kvc_compile_builds(tmp_path):
    """compile_static resolves the prefill chunk, KV type and attention as `kvc compile` does:
    the same source gives the same plan and byte-identical models either way."""
    from kvc.export.compile import compile_static

    kvc("compile", fixtures.path("llama"), "-o", tmp_path / "cli", "--max-prompt-len", "64", "--min-response-len", "64")
    compile_to(fixtures.path("llama"), tmp_path / "lib",
               CompileOptions(compile_static(max_prompt_len=64, min_response_len=64)))
    cli, lib = (json.loads((tmp_path / side / "manifest.json").read_text()) for side in ("cli", "lib"))
    assert cli["plan"] == lib["plan"] and cli["plan"]["kv"][0]["element_type"] == lib["plan"]["kv"][0]["element_type"]
    for entry in cli["models"].values():
        assert (tmp_path / "cli" / entry["xml"]).read_bytes() == (tmp_path / "lib" / entry["xml"]).read_bytes()
    assert StaticOptions().kv_precision == "f32" and compile_static(("NPU",)).kv_precision == "f16"


def test_compile_and_open_serves_the_checked_blobs_without_importing_them_again(tmp_path, monkeypatch):
    """compile_and_open gives the pipeline open_compiled gives (the same tokens and logits on
    prompts that run every prefill model and both generate variants), built on the blobs its
    check imported: each blob file is imported once in the whole call, and the pipeline runs
    from OUT after the work directory it was imported from is renamed."""
    from kvc.export.compile import compile_and_open, compile_static
    from kvc.export.load import _Imports

    imported, sweeps = [], []
    real = _Imports._import
    monkeypatch.setattr(_Imports, "_import", lambda self, name, blob, sweep: imported.append(blob["file"]) or
                        sweeps.append(sweep) or real(self, name, blob, sweep))
    out = tmp_path / "out"
    # bf16's chunks (first 16 and 128, 16, a bulk 128) whatever the host computes by default
    options = CompileOptions(compile_static(precision="bf16", max_prompt_len=320, min_response_len=64, variants=(128,)),
                             inference_precision="bf16")
    manifest, pipe = compile_and_open(fixtures.path("llama"), out, options)
    files = {m["blobs"]["CPU"]["file"] for m in manifest["models"].values()}
    assert sorted(imported) == sorted(files) and len(files) == 1 + 2  # the If blob, two generate variants
    # kept to serve, swept as an open sweeps (the If blob behind its packing where it computes at
    # bf16, unswept where the host computes f32 whatever is asked; then from the start)
    if_blob = next(m["blobs"]["CPU"] for m in manifest["models"].values() if "branches" in m["blobs"]["CPU"])
    first = "behind" if if_blob["import_config"]["INFERENCE_PRECISION_HINT"] == "bf16" else "none"
    assert imported[0] == if_blob["file"] and sweeps == [first, "all", "all"]
    assert set(manifest["models"]) == {"prefill", "prefill-128", "first-16", "first-128", "generate-128", "generate-448"}
    assert manifest == read_manifest(out) and not list(tmp_path.glob(".out.partial-*"))
    opened, variants = open_compiled(out, "openvino"), set()
    # the first chunk of 16, then the first of 128, the bulk chunk and the chunk over their past
    for ids, new in (([5, 6, 7], 130), (list(range(3, 268)), 20)):
        got, want = pipe.generate(ids, new), opened.generate(ids, new)
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(np.stack(got.logits), np.stack(want.logits))
        variants.update(got.variants)
    assert variants == {128, 448}


def test_compile_and_open_refuses_a_device_it_does_not_compile_for(tmp_path):
    from kvc.export.compile import compile_and_open

    with pytest.raises(UsageError, match="cannot open the pipeline on NPU: the compile is for CPU"):
        compile_and_open(fixtures.path("llama"), tmp_path / "out", CompileOptions(SMALL), device="NPU")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("chunk,first", [(16, 32), (32, 24)])
def test_a_first_chunk_model_runs_a_prompts_first_positions_and_is_checked(tmp_path, chunk, first):
    """--prefill-first 32 (chunk 16, P 64): a model of 32 rows with no past input, named
    first-32, runs positions [0, 32) of a fresh prompt; the compile's probes run it (the
    probe of 25 tokens) and its rows pass the check against the source; generation from the
    directory gives the unchunked pipeline's tokens. A first chunk off the chunk's grid (24
    with a chunk of 32) too: a 40-token prompt runs first 24, then the chunk from 24."""
    from kvc.runtime.static_pipeline import prefill_calls

    out = tmp_path / "out"
    kvc("compile", fixtures.path("llama"), "-o", out, *CLI_SMALL, "--prefill-chunk-size", str(chunk),
        "--prefill-first", str(first), "--prefill-first-rows", "static")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["plan"]["lengths"]["prefill_first_chunks"] == [first]
    model = manifest["models"][f"first-{first}"]
    assert {p["name"] for p in model["inputs"]} == {"input_ids", "attention_mask", "position_ids"}
    assert [p["shape"] for p in model["inputs"] if p["name"] == "attention_mask"] == [[1, first]]
    probes = [p["prompt_tokens"] for p in manifest["verification"]["results"]]
    assert any(c.first for n in probes for c in prefill_calls(0, n, (), 64, (chunk,), (first,)))
    assert list(prefill_calls(0, 40, (), 64, (chunk,), (first,)))[0] == (0, min(40, first), first, True)
    whole = tmp_path / "whole"
    kvc("compile", fixtures.path("llama"), "-o", whole, *CLI_SMALL, "--prefill-chunk-size", "0", "--no-verify")
    for ids in ("1,2,3", ",".join(str(i) for i in range(5, 45))):
        got = kvc("run", out, "--prompt-ids", ids, "--max-new-tokens", "5", "--backend", "numpy", "--json")
        want = kvc("run", whole, "--prompt-ids", ids, "--max-new-tokens", "5", "--backend", "numpy", "--json")
        assert json.loads(got.stdout)["tokens"] == json.loads(want.stdout)["tokens"]


@pytest.mark.parametrize("rows,probe", [("static", 25), ("dynamic", 7)])
def test_a_first_chunk_model_that_writes_wrong_rows_is_refused(tmp_path, monkeypatch, rows, probe):
    """The check is not fooled by a first-chunk model, of static rows or dynamic: its KV rows
    negated (in the IR's runs and the blobs') fail the compile (exit 4) at the probe that runs
    it (a dynamic one runs the shortest)."""
    from kvc.runtime.static_pipeline import StaticPipeline

    real_init = StaticPipeline.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        for session in self.first_sessions.values():
            def wrong(feed, infer=session.infer):
                out = dict(infer(feed))
                for spec in self.kv:
                    out[spec.output] = -out[spec.output]
                return out
            session.infer = wrong

    monkeypatch.setattr(StaticPipeline, "__init__", init)
    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "out", *CLI_SMALL, "--prefill-chunk-size", "16",
                 "--prefill-first", "32", "--prefill-first-rows", rows, code=4)
    assert re.search(rf"prompt of {probe} tokens: (token \d+ differs|logits differ|KV cache row \d+ of past_key_values)",
                     result.output), result.output


def test_a_first_chunk_of_dynamic_rows_computes_a_prompts_first_tokens_unpadded(tmp_path):
    """--prefill-first 32 --prefill-first-rows dynamic (chunk 16, P 64): one model first-32
    whose token inputs and mask are [1, -1] and whose present rows are dynamic, in the CPU
    blob's If chain, ahead of the chunk (its outputs padded to static shapes there); a prompt of 1
    to 32 tokens is one call of its own rows, a longer one continues with the chunk. From the
    blobs and on kvc's numpy runtime, prompts of 1, 5, 32 and 40 tokens generate what the
    unchunked pipeline does, logits to within f32 blobs' rounding (the precision it is chosen at)."""
    from kvc.runtime.static_pipeline import prefill_calls

    out, whole = tmp_path / "out", tmp_path / "whole"
    kvc("compile", fixtures.path("llama"), "-o", out, *CLI_SMALL, "--prefill-chunk-size", "16",
        "--prefill-first", "32", "--prefill-first-rows", "dynamic", "--inference-precision", "f32")
    kvc("compile", fixtures.path("llama"), "-o", whole, *CLI_SMALL, "--prefill-chunk-size", "0", "--no-verify",
        "--inference-precision", "f32")
    manifest = read_manifest(out)
    assert manifest["plan"]["lengths"]["prefill_first_rows"] == "dynamic"
    model = manifest["models"]["first-32"]
    assert {p["name"]: p["shape"] for p in model["inputs"]} == {"input_ids": [1, -1], "attention_mask": [1, -1],
                                                                "position_ids": [1, -1]}
    assert all(p["shape"][2] == -1 for p in model["outputs"] if p["name"].startswith("present."))
    assert model["blobs"]["CPU"]["branches"] == ["first-32", "prefill"]  # every prompt's first call leads
    for n in (5, 32, 40):
        assert list(prefill_calls(0, n, (), 64, (16,), (32,), True))[0] == (0, min(n, 32), 32, True)
    blobs, numpy_runtime, unchunked = (open_compiled(out, "openvino"), open_compiled(out, "numpy"),
                                       open_compiled(whole, "numpy"))
    for n in (1, 5, 32, 40):
        ids = list(range(3, 3 + n))
        want = unchunked.generate(ids, 4)
        for pipe in (blobs, numpy_runtime):
            got = pipe.generate(ids, 4)
            assert got.tokens == want.tokens
            np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), rtol=0, atol=1e-4)


def test_a_first_chunk_of_dynamic_rows_is_for_the_cpu_only(tmp_path):
    """The NPU runs static shapes only: --prefill-first-rows dynamic with an NPU device is a
    usage error (exit 2) naming the device; auto is static there and dynamic for an f32 CPU
    compile with a chunk."""
    from kvc.export.compile import resolve_first_rows

    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "out", *CLI_SMALL, "--device", "CPU", "--device", "NPU",
                 "--prefill-chunk-size", "16", "--prefill-first", "32", "--prefill-first-rows", "dynamic", code=2)
    assert "--prefill-first-rows dynamic is for CPU-only compiles: NPU runs static shapes only" in result.output
    assert not (tmp_path / "out").exists()
    assert resolve_first_rows("auto", ("CPU", "NPU"), "f32", 16) == "static"
    assert resolve_first_rows("auto", ("CPU",), "f32", 16) == "dynamic"
    assert resolve_first_rows("auto", ("CPU",), "bf16", 16) == "static"
    assert resolve_first_rows("auto", ("CPU",), "f32", 0) == "static"


def test_kvc_build_digests_every_package_pyproject_installs(tmp_path, monkeypatch):
    """`kvc_build` hashes the .py files of kvc's packages: the list is pyproject.toml's, and a
    change to any file of them (here, one added) is another build."""
    import tomllib
    from pathlib import Path

    import kvc.export.manifest as manifest

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert manifest.PACKAGES == tuple(pyproject["tool"]["setuptools"]["packages"])
    before = manifest.kvc_build()
    extra = tmp_path / "pkg"
    extra.mkdir()
    (extra / "added.py").write_text("x = 1\n")
    monkeypatch.setattr(manifest, "PACKAGES", (*manifest.PACKAGES, "kvc_test_extra"))
    import importlib.machinery
    import sys

    spec = importlib.machinery.ModuleSpec("kvc_test_extra", None, is_package=True)
    spec.submodule_search_locations = [str(extra)]
    monkeypatch.setitem(sys.modules, "kvc_test_extra", importlib.util.module_from_spec(spec))
    manifest.kvc_build.cache_clear()
    try:
        assert manifest.kvc_build() != before
    finally:
        manifest.kvc_build.cache_clear()


def test_longrope_past_its_original_positions_compiles_chunked_and_the_switch_probe_guards_it(tmp_path, monkeypatch):
    """phi3_longrope (LongRoPE, 64 original positions, P 128): the source takes a call's rotary
    factors long when its longest position reaches 64, so a prompt longer than that is rotated
    at the long factors whole. A prefill in chunks rotated its first chunks at the short ones,
    and kvc compiled such a model unchunked (its TTFT followed P). Now each prefill call reads
    the prompt's last position (`kvc.passes.prompt_end`): the CPU's default compile is chunked,
    records the switch for the caches, and verifies. Without the pass the switch probe (73
    tokens) refuses the chunked compile, as it refused it before."""
    from kvc.export.compile import model_longrope
    from kvc.passes.framework.base import PassResult
    from kvc.passes.prompt_end import PromptEnd

    source = fixtures.path("phi3_longrope")
    assert model_longrope(source) == 64 and model_longrope(fixtures.path("phi3")) is None
    out = tmp_path / "out"
    kvc("compile", source, "-o", out)
    options = json.loads((out / "manifest.json").read_text())["plan"]["options"]
    assert options["prefill_chunk_size"] and options["longrope_switch"] == 64
    assert "verification: OK" in kvc("verify", out, "--backends", "numpy").output
    monkeypatch.setattr(PromptEnd, "run", lambda self, model: PassResult(model, False))
    refused = kvc("compile", source, "-o", tmp_path / "chunked", "--prefill-chunk-size", "16", code=4)
    assert "prompt of 73 tokens" in refused.output and not (tmp_path / "chunked").exists()
