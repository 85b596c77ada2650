"""bf16 values as OpenVINO rounds them (`kvc.runtime.ops.movement.round_to_bf16`), against
OpenVINO's own constant folding and its CPU plugin: not IEEE's nearest-even, which rounds a
dropped part above half a unit up whatever the kept part; OpenVINO truncates below an even kept
part. Falcon's ALiBi (`slopes.bfloat16() x positions`) takes positions past 512 so."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino import passes

from kvc.runtime.interpreter import Interpreter
from kvc.runtime.ops.movement import round_to_bf16


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
    if cpu[515] == 515:  # a CPU without bf16 computes it at f32 (ConvertPrecision): no rounding at all
        assert np.array_equal(cpu[:4096], x[:4096])
        return
    np.testing.assert_array_equal(round_to_bf16(x), cpu)
    positions = np.arange(0, 4096, dtype=np.int64)
    np.testing.assert_array_equal(round_to_bf16(positions.astype(np.float32)), _on_cpu(positions, [4096]))


def test_not_ieee_nearest_even():
    """The difference shown: IEEE gives 516 and 520 (what PyTorch computes), OpenVINO 512 and 520."""
    got = round_to_bf16(np.array([515, 518, 519, 1.0 + 2.0 ** -8 + 2.0 ** -12], np.float32))
    np.testing.assert_array_equal(got, [512, 520, 520, 1.0])


def test_the_interpreter_converts_to_bf16_so():
    p = ops.parameter([3], ov.Type.i64, name="positions")
    model = ov.Model([ops.convert(ops.convert(p, ov.Type.bf16), ov.Type.f32)], [p])
    model.output(0).get_tensor().set_names({"y"})
    got = Interpreter(model).run({"positions": np.array([515, 523, 531])})["y"]
    np.testing.assert_array_equal(got, [512, 520, 528])
