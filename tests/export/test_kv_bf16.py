"""A bf16 KV cache (`--kv-precision bf16`, CPU only).

Numpy has no bf16: kvc's interpreter holds it as f32 carrying bf16 values, a device session
as ml_dtypes.bfloat16 (OpenVINO's Python API shows bf16 data as float16, another number for the
same bits). These tests run on any host: the blobs compute at f32 here, with bf16 KV ports.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from kvc import fixtures
from kvc.errors import UsageError
from kvc.export.compile import CompileOptions, check_kv, compile_to
from kvc.export.load import open_compiled
from kvc.plan import StaticOptions
from kvc.runtime.interpreter import cpu_rounds_bf16
from kvc.runtime.session import OpenVINOSession

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_a_bf16_cache_is_refused_for_the_npu():
    """NPUW's requests take f16 for a bf16 port ("Failed to set tensor ... precision: bf16, since the
    model input tensor precision is: f16"): refused before compiling, not in the blob check."""
    for devices in (("NPU",), ("CPU", "NPU")):
        with pytest.raises(UsageError, match="bf16 cannot be compiled for the NPU"):
            check_kv("bf16", devices)
    check_kv("bf16", ("CPU",))
    with pytest.raises(UsageError, match="bf16 cannot be compiled for the NPU"):
        compile_to(fixtures.path("llama"), "/nonexistent/never-written", CompileOptions(
            StaticOptions(64, 64, kv_precision="bf16"), devices=("NPU",)))


def test_openvino_session_reads_and_writes_bf16_ports():
    x = ops.parameter([1, 4], ov.Type.bf16, name="x")
    x.output(0).set_names({"x"})
    y = ops.convert(ops.multiply(ops.convert(x, ov.Type.f32), ops.constant(np.float32(3.0))), ov.Type.bf16)
    y.output(0).set_names({"y"})
    session = OpenVINOSession(ov.Model([y], [x]))
    assert session.input_dtype("x") == BF16
    given = np.array([[1.0, 1.5, -2.0, 0.1]], np.float32)
    want = (given.astype(BF16).astype(np.float32) * 3).astype(BF16)
    out = session.infer({"x": given})["y"]
    assert out.dtype == BF16
    np.testing.assert_array_equal(out, want)  # read as float16, 3.0 (0x4040) would be 2.125
    buffer = np.array([[4.0, 0.5, 8.0, -1.0]], BF16)
    session.bind("x", buffer, 1, 0)
    np.testing.assert_array_equal(session.infer({})["y"].astype(np.float32), [[12.0, 1.5, 24.0, -3.0]])
    buffer[0, 0] = 2.0  # bound, not copied
    assert session.infer({})["y"].astype(np.float32)[0, 0] == 6.0


@pytest.fixture(scope="module")
def compiled_bf16(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "out"
    options = StaticOptions(max_prompt_len=64, min_response_len=32, variants=(80,), prefill_chunk_size=16,
                            kv_precision="bf16")
    manifest = compile_to(fixtures.path("llama"), out, CompileOptions(options, inference_precision="f32"))
    return out, manifest


def test_bf16_cache_compiles_verifies_and_runs_from_blobs(compiled_bf16):
    out, manifest = compiled_bf16
    assert {k["element_type"] for k in manifest["plan"]["kv"]} == {"bf16"}
    assert manifest["verification"]["ok"]
    prompt = fixtures.goldens("llama")["prompts"][2]
    numpy_pipe, blob_pipe = open_compiled(out, "numpy"), open_compiled(out, "openvino")
    assert {b.dtype for b in numpy_pipe.buffers.values()} == {np.dtype(np.float32)}
    assert {b.dtype for b in blob_pipe.buffers.values()} == {BF16}
    ref, got = numpy_pipe.generate(prompt["ids"], 24), blob_pipe.generate(prompt["ids"], 24)
    assert got.tokens == ref.tokens == prompt["tokens"]["openvino"]
    # Both compute in f32 and round the cache to bf16 the same way: the logits agree to f32's
    # summation order, where a cache misread (or kept at f32 on one side) moves them by far more.
    # A CPU without bf16 (AVX2) converts the blob's present rows to bf16 its own way, neither
    # cut nor by nearest even (each agrees on 75% of random values, one bf16 unit apart
    # elsewhere): there the rows drift apart over the steps and the logits by up to 0.02, and
    # only the tokens are compared.
    close = cpu_rounds_bf16()
    if close:
        np.testing.assert_allclose(np.stack(got.logits), np.stack(ref.logits), atol=2e-3)
    for name, buffer in blob_pipe.buffers.items():
        held = numpy_pipe.buffers[name]
        assert np.array_equal(held, held.astype(BF16).astype(np.float32)), "numpy's cache holds bf16 values"
        if close:
            np.testing.assert_allclose(buffer.astype(np.float32), held, rtol=2 ** -7, atol=1e-6)


def test_a_bf16_directory_on_the_npu_backend_is_a_clear_error(compiled_bf16):
    out, _ = compiled_bf16
    with pytest.raises(UsageError, match="has no NPU blobs, only CPU"):
        open_compiled(out, "npu")
    with pytest.raises(UsageError, match="compile it again with --kv-precision f16"):
        open_compiled(out, "npu", from_ir=True)
