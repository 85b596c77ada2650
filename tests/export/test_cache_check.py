"""The cache check (kvc.verify.cache_rows): the rows a static pipeline holds after a run must be
the source model's own cache rows, read the way the generate models read them."""

from __future__ import annotations

import numpy as np
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.plan import KVSpec, StaticOptions
from kvc.runtime.compare import INT8_KV_NRMSE, judge
from kvc.runtime.session import OpenVINOSession
from kvc.verify.cache_rows import ROW_ERROR, compare_cache, source_run
from kvc.verify.compiled import judge_run
from tests.passes.test_kv_int8 import put_back_the_unchunked_prefill_bug, unchunked_int8_probe


def specs(element_type="f32", layers=2):
    return [KVSpec(f"past_key_values.{i}.{kind}", f"present.{i}.{kind}", i, kind, 2, element_type, (1, 2, 8, 4))
            for i in range(layers) for kind in ("key", "value")]


def cache(seed=0, rows=6, layers=2):
    rng = np.random.default_rng(seed)
    return {f"past_key_values.{i}.{kind}": rng.normal(size=(1, 2, rows, 4)).astype(np.float32)
            for i in range(layers) for kind in ("key", "value")}


def test_the_same_rows_pass_and_a_row_off_by_its_channels_fails_naming_it():
    ref = cache()
    assert compare_cache(ref, {k: v.copy() for k, v in ref.items()}, specs(), 6).ok
    held = {k: v.copy() for k, v in ref.items()}
    held["past_key_values.1.key"][0, :, 4] *= np.array([0.6, 1.0, 1.7, 1.2], np.float32)  # another scale per channel
    check = compare_cache(ref, held, specs(), 6)
    assert not check.ok and (check.tensor, check.position) == ("past_key_values.1.key", 4)
    assert "row 4 of past_key_values.1.key is not the source model's" in check.reason()
    assert compare_cache(ref, held, specs(), 4).ok  # the rows both runs fed: the bad one is past them
    assert compare_cache(ref, held, specs(), 6, every_layer=False).ok  # the first layer's only


def test_a_nan_row_fails_and_rounding_passes_only_where_the_cache_type_rounds():
    ref = cache()
    held = {k: v.copy() for k, v in ref.items()}
    held["past_key_values.0.value"][0, 1, 2, 3] = np.nan
    assert not compare_cache(ref, held, specs(), 6).ok
    halves = {k: v.astype(np.float16).astype(np.float32) for k, v in ref.items()}
    assert compare_cache(ref, halves, specs("f16"), 6).ok
    assert not compare_cache(ref, halves, specs("f32"), 6).ok  # f16 rounding is not an f32 cache's
    assert ROW_ERROR["f32"] < ROW_ERROR["f16"] < ROW_ERROR["bf16"] < ROW_ERROR["i8"]


@pytest.mark.parametrize("name", ["falcon", "gptj"])
def test_keys_read_back_with_other_scales_are_refused_where_the_logits_pass(name, monkeypatch):
    """kvc's old int8 bug, put back: an unchunked prefill quantizes its keys without the
    calibrated channels the generate models multiply them by. On falcon and gptj every step's
    logits stayed within the per-step bound and the flip within the noise (compile's check
    said OK); their cache rows are off by 1.5-1.7 of their RMS (int8's bound: 0.15)."""
    put_back_the_unchunked_prefill_bug(monkeypatch)
    kv, ref, got = unchunked_int8_probe(name, 32)
    assert judge(ref, got, reduced=True, limit=INT8_KV_NRMSE).ok  # what the logits alone say
    row = judge_run(ref, got, kv, reduced=True, limit=INT8_KV_NRMSE)
    assert not row["ok"] and "KV cache row" in row["reason"] and row["cache_error"] > 1.0
    monkeypatch.undo()  # and the fixed pass passes
    kv, ref, got = unchunked_int8_probe(name, 32)
    row = judge_run(ref, got, kv, reduced=True, limit=INT8_KV_NRMSE)
    assert row["ok"] and row["cache_ok"] and row["cache_error"] < 0.05, row["reason"]


def test_a_stateless_source_gives_its_cache_by_input_name():
    """The ONNX export runs stateless (its past fed back as inputs): its cache is the last past,
    named as the stateful export's variables are (`source_run`), and holds the same rows."""
    from kvc.runtime.session import open_session

    onnx = open_session(fixtures.path("gpt2", "onnx"), "onnxruntime")
    stateful = OpenVINOSession(ir.load(fixtures.path("gpt2")))
    prompt = [5, 9, 100, 7, 3]
    ra, rb = (source_run(session, prompt, 4).cache for session in (onnx, stateful))
    assert sorted(ra) == sorted(rb) and all(name.startswith("past_key_values.") for name in ra)
    assert compare_cache(rb, ra, specs(layers=2), len(prompt) + 3).ok


@pytest.mark.parametrize("factor", [1.12])
def test_a_blob_storing_other_rows_than_its_ir_is_never_published(tmp_path, monkeypatch, factor):
    """CPU blobs whose generate models store layer 0's value rows `factor` times too large (the
    IR's are right) are never published. They kept the IR's tokens and logits within the fixed
    reduced-precision rules and were refused for their rows; with the bounds the plugin's own
    drift sets (kvc.verify.peer_drift), their logits' step error (0.095 against 3x the peer's
    0.010) refuses them first. (The rows alone refuse blobs in test_peer_drift.py.)"""
    import openvino.opset13 as ops

    import kvc.export.compile as compile_mod
    from kvc.errors import VerificationError
    from kvc.export.compile import CompileOptions, compile_to

    real = compile_mod.embed_small_constants

    def faulty(model):
        real(model)
        for result in model.get_results():
            if "present.0.value" in result.output(0).get_names() and model.input("input_ids").get_shape()[1] == 1:
                source = result.input_value(0)
                scale = ops.convert(ops.constant(np.float32(factor)), source.get_element_type())
                result.input(0).replace_source_output(ops.multiply(source, scale).output(0))

    monkeypatch.setenv("KVC_DEVICE_COMPILE", "in-process")  # the patch applies to this process only
    monkeypatch.setattr(compile_mod, "embed_small_constants", faulty)
    options = CompileOptions(StaticOptions(64, 32, prefill_chunk_size=16, kv_precision="bf16"), devices=("CPU",))
    # at bf16 (the host's or emulated) by the peer's bounds; a host's f32 blobs by the exact rules
    with pytest.raises(VerificationError, match=r"the CPU blobs do not reproduce the static IR: .*(KV cache row \d+ "
                                                r"of past_key_values\.0\.value is not the IR's|step \d+'s logits are "
                                                r"not the reference's: .*(and bounds this run at 3x that|at most))"):
        compile_to(fixtures.path("llama"), tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


def test_values_stored_transposed_are_compared_along_their_keys_sequence(tmp_path):
    """--transpose-v on llama (2 KV heads, head size 16): a far probe's 2 rows lined up with the
    source's heads axis first, and a correct compile was refused ("KV cache row 0 of
    past_key_values.0.value is not the source model's"); `kvc verify`'s 16-row runs lined up
    with its head dimension, against the source and against the IR's rows."""
    from tests.cli.runner import SMALL, kvc

    kvc("compile", fixtures.path("llama"), "-o", tmp_path / "out", *SMALL, "--transpose-v")
    kvc("verify", tmp_path / "out")
    kvc("verify", tmp_path / "out", "--backends", "numpy", "--against", fixtures.path("llama").parent / "stateless")
