"""bf16 values as OpenVINO computes them. OpenVINO rounds to bf16 two ways: its `bfloat16`
type (`kvc.runtime.ops.movement.openvino_bf16`: an even kept part truncates, 515 -> 512),
which its constant folding uses, and its CPU plugin for an integer's Convert and for an f32's
of dynamic shape; and IEEE's nearest even (`round_to_bf16`: 515 -> 516, PyTorch's too), which
the CPU plugin's JIT kernels use for an f32's Convert of static shape (a blob's bf16 cache) and
for bf16 arithmetic. kvc's interpreter rounds an integer's Convert the first way and everything
else the second, and leaves a model's own bf16 unrounded on a CPU without bf16. Falcon's ALiBi
(`slopes.bfloat16() x positions`) takes both."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino import passes

from kvc.runtime.interpreter import Interpreter, cpu_rounds_bf16
from kvc.runtime.ops.movement import openvino_bf16, round_to_bf16
from tests.passes.test_relative_alibi import falcon_1024


def _values() -> np.ndarray:
    """Integers past 256 (positions), random f32 bit patterns of every exponent but NaN's, and
    the edges: +-0, subnormals, the largest finite values, infinities."""
    bits = np.random.default_rng(0).integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32)
    rand = bits.view(np.float32)
    rand = rand[~np.isnan(rand)]
    edges = np.array([0.0, -0.0, 1e-40, -1e-40, 3.4028235e38, -3.4028235e38, np.inf, -np.inf], np.float32)
    return np.concatenate([np.arange(0, 4096, dtype=np.float32), rand, edges])


def _to_bf16_and_back(etype: ov.Type, shape) -> ov.Model:
    p = ops.parameter(shape, etype, name="x")
    model = ov.Model([ops.convert(ops.convert(p, ov.Type.bf16), ov.Type.f32)], [p])
    model.output(0).get_tensor().set_names({"y"})
    return model


def _on_cpu(model: ov.Model, x: np.ndarray) -> np.ndarray:
    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(x)[0]


def test_openvino_bf16_is_openvinos_constant_folding():
    x = _values()
    model = ov.Model([ops.convert(ops.convert(ops.constant(x), ov.Type.bf16), ov.Type.f32)], [])
    manager = passes.Manager()
    manager.register_pass(passes.ConstantFolding())
    manager.run_passes(model)
    (folded,) = [op for op in model.get_ops() if op.get_type_name() == "Constant"]
    np.testing.assert_array_equal(openvino_bf16(x), np.asarray(folded.get_data()))


def test_the_interpreter_converts_to_bf16_as_openvino_cpu_does():
    """An integer (Falcon's positions) of static or dynamic shape, and an f32 of static shape
    (a static model's): each as the CPU plugin converts it. (An f32 of dynamic shape the plugin
    rounds as an integer: the one case kvc does not follow.)"""
    positions = np.arange(0, 4096, dtype=np.int64)
    floats = _values()
    floats = floats[(np.abs(floats) >= np.finfo(np.float32).tiny) | (floats == 0)]  # its JIT flushes subnormals
    for model, x in ((_to_bf16_and_back(ov.Type.i64, [4096]), positions),
                     (_to_bf16_and_back(ov.Type.i64, [-1]), positions),
                     (_to_bf16_and_back(ov.Type.f32, [floats.size]), floats)):
        cpu = _on_cpu(model, x)
        if not cpu_rounds_bf16():  # a CPU without bf16 computes it at f32 (ConvertPrecision): no rounding
            np.testing.assert_array_equal(cpu[:4096], x[:4096].astype(np.float32))
        np.testing.assert_array_equal(Interpreter(model).run({"x": x})["y"], cpu)
    if cpu_rounds_bf16():
        np.testing.assert_array_equal(_on_cpu(_to_bf16_and_back(ov.Type.i64, [4096]), positions),
                                      openvino_bf16(positions.astype(np.float32)))
        np.testing.assert_array_equal(_on_cpu(_to_bf16_and_back(ov.Type.f32, [floats.size]), floats),
                                      round_to_bf16(floats))


def test_the_two_roundings():
    """Where they differ: a dropped part above half a unit under an even kept part."""
    x = np.array([515, 518, 519, 1.0 + 2.0 ** -8 + 2.0 ** -12], np.float32)
    np.testing.assert_array_equal(openvino_bf16(x), [512, 520, 520, 1.0])
    np.testing.assert_array_equal(round_to_bf16(x), [516, 520, 520, 1.0 + 2.0 ** -7])


def _positions_model() -> ov.Model:
    p = ops.parameter([3], ov.Type.i64, name="positions")
    model = ov.Model([ops.convert(ops.convert(p, ov.Type.bf16), ov.Type.f32)], [p])
    model.output(0).get_tensor().set_names({"y"})
    return model


def test_the_interpreter_converts_a_models_own_values_as_the_cpu_does():
    positions = np.array([515, 523, 531])
    got = Interpreter(_positions_model()).run({"positions": positions})["y"]
    cpu = ov.Core().compile_model(_positions_model(), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(positions)[0]
    np.testing.assert_array_equal(got, cpu)
    np.testing.assert_array_equal(got, [512, 520, 528] if cpu_rounds_bf16() else positions)


# A host whose CPU has no bf16 (AVX2 alone: Meteor Lake, the first NPU laptops), as oneDNN is told
# to see this one: the plugin computes a model's bf16 values at f32, and so must kvc's interpreter.
AVX2 = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_on_a_cpu_without_bf16_the_interpreter_leaves_a_models_own_bf16_unrounded():
    code = ("import numpy as np; from kvc.runtime.interpreter import Interpreter, cpu_rounds_bf16; "
            "from tests.runtime.test_bf16 import _positions_model; "
            "print(cpu_rounds_bf16(), Interpreter(_positions_model()).run({'positions': np.array([515, 523, 531])})['y'])")
    out = subprocess.run([sys.executable, "-c", code], env=AVX2, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "[515.", "523.", "531.]"], out


def test_falcon_alibi_past_512_positions_compiles_on_a_cpu_without_bf16(tmp_path):
    """There the source's positions are not rounded (OpenVINO CPU computes them at f32): kvc's
    IR check, rounding them, refused the correct compile (0.114 on 521 tokens)."""
    source = falcon_1024(tmp_path)
    exe = shutil.which("kvc", path=os.path.dirname(sys.executable))
    # f32 as such a host's plugin picks (this one's still reports bf16, which oneDNN then lacks)
    done = subprocess.run([exe, "compile", str(source), "-o", str(tmp_path / "out"), "--max-prompt-len", "768",
                           "--min-response-len", "128", "--inference-precision", "f32"],
                          env=AVX2, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_bf16_arithmetic_rounds_as_openvino_cpu_rounds_it():
    """A Multiply at bf16 (Falcon's ALiBi with 32 heads: slopes 2^(-k/4) times bf16 positions):
    OpenVINO CPU rounds the product by IEEE's nearest even; kvc computed it at f32 and did not
    round it at all (up to 2.0 off at position 1000)."""
    slopes = (2.0 ** (-0.25 * np.arange(1, 33))).astype(np.float32).reshape(1, 32, 1)
    p = ops.parameter([1, -1], ov.Type.i64, name="positions")
    bias = ops.multiply(ops.convert(ops.constant(slopes), ov.Type.bf16),
                        ops.convert(ops.unsqueeze(p, ops.constant(np.int64(1))), ov.Type.bf16))
    model = ov.Model([ops.convert(bias, ov.Type.f32)], [p])
    model.output(0).get_tensor().set_names({"y"})
    positions = np.arange(1024).reshape(1, -1)
    cpu = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(positions)[0]
    got = Interpreter(model).run({"positions": positions})["y"]
    np.testing.assert_array_equal(got, cpu)
    if cpu_rounds_bf16():
        product = round_to_bf16(slopes) * openvino_bf16(positions.astype(np.float32))[:, None, :]
        assert np.abs(product - got).max() >= 1.0  # the rounding kvc skipped
