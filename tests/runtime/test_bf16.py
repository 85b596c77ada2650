"""bf16 values as OpenVINO rounds them (`kvc.runtime.ops.movement.round_to_bf16`), against
OpenVINO's own constant folding and its CPU plugin: not IEEE's nearest-even, which rounds a
dropped part above half a unit up whatever the kept part; OpenVINO truncates below an even kept
part. Falcon's ALiBi (`slopes.bfloat16() x positions`) takes positions past 512 so."""

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
from kvc.runtime.ops.movement import round_to_bf16
from tests.passes.test_relative_alibi import falcon_1024


def _values() -> np.ndarray:
    """Integers past 256 (positions), random f32 bit patterns of every exponent but NaN's, and
    the edges: +-0, subnormals, the largest finite values, infinities."""
    bits = np.random.default_rng(0).integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32)
    rand = bits.view(np.float32)
    rand = rand[~np.isnan(rand)]
    edges = np.array([0.0, -0.0, 1e-40, -1e-40, 3.4028235e38, -3.4028235e38, np.inf, -np.inf], np.float32)
    return np.concatenate([np.arange(0, 4096, dtype=np.float32), rand, edges])


def _as_f32(model: ov.Model) -> ov.Model:
    return ov.Model([ops.convert(model.output(0), ov.Type.f32)], model.get_parameters())


def _folded(x: np.ndarray) -> np.ndarray:
    model = ov.Model([ops.convert(ops.convert(ops.constant(x), ov.Type.bf16), ov.Type.f32)], [])
    manager = passes.Manager()
    manager.register_pass(passes.ConstantFolding())
    manager.run_passes(model)
    (folded,) = [op for op in model.get_ops() if op.get_type_name() == "Constant"]
    return np.asarray(folded.get_data())


def _on_cpu(x: np.ndarray, shape) -> np.ndarray:
    p = ops.parameter(shape, ov.Type.i64 if x.dtype == np.int64 else ov.Type.f32)
    model = ov.Model([ops.convert(ops.convert(p, ov.Type.bf16), ov.Type.f32)], [p])
    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(x)[0]


def test_bf16_rounds_as_openvinos_constant_folding():
    x = _values()
    np.testing.assert_array_equal(round_to_bf16(x), _folded(x))


def test_bf16_rounds_as_openvino_cpu_converts_a_source_models_values():
    """The CPU plugin's Convert rounds so an f32 value of dynamic shape (a source model's) and
    an integer of any shape (Falcon's positions, in the source and in the static models). Two
    Converts f32 -> bf16 -> f32 of static shape it fuses and rounds as IEEE does (515: 516):
    the one case kvc's interpreter does not follow, as it holds a model's semantics, not the
    plugin's fusions."""
    x = _values()
    cpu = _on_cpu(x, [-1])
    if not cpu_rounds_bf16():  # a CPU without bf16 computes it at f32 (ConvertPrecision): no rounding at all
        assert np.array_equal(cpu[:4096], x[:4096])
        return
    np.testing.assert_array_equal(round_to_bf16(x), cpu)
    positions = np.arange(0, 4096, dtype=np.int64)
    np.testing.assert_array_equal(round_to_bf16(positions.astype(np.float32)), _on_cpu(positions, [4096]))


def test_not_ieee_nearest_even():
    """The difference shown: IEEE gives 516 and 520 (what PyTorch computes), OpenVINO 512 and 520."""
    got = round_to_bf16(np.array([515, 518, 519, 1.0 + 2.0 ** -8 + 2.0 ** -12], np.float32))
    np.testing.assert_array_equal(got, [512, 520, 520, 1.0])


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
