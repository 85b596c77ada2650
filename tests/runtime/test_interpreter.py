"""The interpreter's contract: unsupported ops listed up front, errors with context, trace and
capture modes, state like OpenVINO's query_state, clear input errors."""

from __future__ import annotations


import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.runtime.ops.movement import round_to_bf16
from kvc.runtime.interpreter import (EvaluationError, InputError, Interpreter, UnsupportedOpError, check_supported,
                                    cpu_rounds_bf16)
from kvc.runtime.session import open_session
from tests.passes.models import counter_model


def test_unsupported_ops_are_all_listed_before_running():
    x = ops.parameter([4, 4], np.float32, name="x")
    x.output(0).set_names({"x"})
    rolled = ops.roll(x, ops.constant(np.array([1], np.int64)), ops.constant(np.array([0], np.int64)), name="roll")
    where = ops.bucketize(ops.relu(rolled, name="relu"), ops.constant(np.array([0.5], np.float32)), name="nz")
    model = ov.Model([where, rolled], [x], "m")
    with pytest.raises(UnsupportedOpError) as info:
        check_supported(model)
    text = str(info.value)
    assert "does not implement 2 op type(s)" in text
    assert "Bucketize (opset3) ×1: 'nz'" in text and "Roll (opset7) ×1: 'roll'" in text
    assert "relu" in text.split("Roll (opset7)")[1]  # where it is used
    assert info.value.exit_code == 3


def test_errors_say_while_executing_with_inputs():
    a = ops.parameter([2, 3], np.float32, name="a")
    a.output(0).set_names({"a"})
    shape = ops.parameter([2], np.int64, name="shape")
    shape.output(0).set_names({"shape"})
    model = ov.Model([ops.reshape(a, shape, False, name="bad_reshape")], [a, shape], "m")
    with pytest.raises(EvaluationError) as info:
        Interpreter(model).run({"a": np.zeros((2, 3), np.float32), "shape": np.array([4, 4])})
    msg = str(info.value)
    assert msg.startswith("while executing Reshape bad_reshape: ValueError")
    assert "(inputs: float32:2x3 [0.0, 0.0], int64:2 [4, 4])" in msg


def test_trace_prints_dtype_shape_and_range():
    lines = []
    Interpreter(counter_model()).run({"x": np.array([1.0, 3.0], np.float32)}, trace=lines.append)
    assert "total = Add: float32:2 [1.0, 3.0]" in lines


def test_capture_returns_every_intermediate_by_stable_name():
    model = ir.load(fixtures.path("llama"))
    session = open_session(model, "numpy")
    ids = np.array([[1, 2, 3]])
    out, values = session.capture({"input_ids": ids, "attention_mask": np.ones_like(ids),
                                   "position_ids": np.arange(3)[None], "beam_idx": np.zeros(1, np.int32)})
    assert values["logits"] is not None and np.array_equal(values["logits"], out["logits"])
    assert values["inputs_embeds"].shape == (1, 3, 64)
    names = set(ir.name_model(model)._values.values())
    assert set(values) <= names and len(values) > 150


def test_state_matches_openvino_query_state():
    golden = fixtures.goldens("qwen2")["prompts"][0]["ids"]
    feed = {"input_ids": np.array([golden]), "attention_mask": np.ones((1, len(golden)), np.int64),
            "position_ids": np.arange(len(golden))[None], "beam_idx": np.zeros(1, np.int32)}
    ours, theirs = open_session(fixtures.path("qwen2"), "numpy"), open_session(fixtures.path("qwen2"), "openvino")
    ours.infer(feed)
    theirs.infer(feed)
    a, b = ours.state(), theirs.state()
    assert set(a) == set(b) and len(a) == 4
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5)
    ours.reset()
    assert ours.state() == {}
    ours.set_state(next(iter(b)), b[next(iter(b))])
    np.testing.assert_array_equal(ours.state()[next(iter(b))], b[next(iter(b))])


def test_state_persists_across_calls_and_assigns_commit_at_the_end():
    it = Interpreter(counter_model())
    for expected in ([1.0, 2.0], [2.0, 4.0]):
        out = it.run({"x": np.array([1.0, 2.0], np.float32)})
        np.testing.assert_array_equal(out["total"], expected)
    it.reset()
    np.testing.assert_array_equal(it.run({"x": np.array([5.0, 5.0], np.float32)})["total"], [5.0, 5.0])


@pytest.mark.parametrize("feed,message", [
    ({}, "missing input x"),
    ({"x": np.zeros(3, np.float32)}, "expected shape [2], found [3]"),
    ({"x": np.zeros(2, np.float32), "y": np.zeros(1)}, "unknown input(s) y"),
    ({"x": np.array(["a", "b"])}, "expected element type float32, found <U1"),
])
def test_input_errors(feed, message):
    with pytest.raises(InputError) as info:
        Interpreter(counter_model()).run(feed)
    assert message in str(info.value)


def test_outputs_answer_to_every_tensor_name():
    model = ir.load(fixtures.path("llama", "stateless"))
    session = open_session(model, "numpy")
    out = session.infer({"input_ids": np.array([[1, 2]]), "attention_mask": np.ones((1, 2), np.int64),
                         "position_ids": np.array([[0, 1]]),
                         **{f"past_key_values.{i}.{k}": np.zeros((1, 2, 0, 16), np.float32)
                            for i in range(2) for k in ("key", "value")}})
    assert out["present.0.key"].shape == (1, 2, 2, 16) and "present.1.value" in out
    with pytest.raises(KeyError, match="no output named 'nope'"):
        out["nope"]


def _decompressed_matmul(etype: str, group: int | None, *, to_f32: bool = True):
    """x @ W.T with W as NNCF writes a compressed weight: low-bit Constant -> Convert f16 ->
    Subtract zero point -> Multiply f16 scale -> [Reshape groups] -> Convert f32."""
    r = np.random.default_rng(7)
    lo, hi = {"u8": (0, 256), "i8": (-128, 128), "u4": (0, 16), "i4": (-8, 8)}[etype]
    rows, cols = 8, 32
    blocks = (rows, cols // group, group) if group else (rows, cols)
    q = r.integers(lo, hi, blocks)
    zp = r.integers(lo, hi, blocks[:-1] + (1,))
    scale = r.uniform(0.01, 0.1, blocks[:-1] + (1,)).astype(np.float16)
    x = ops.parameter([1, cols], np.float32, name="x")
    x.output(0).set_names({"x"})

    def low_bit(a):  # not ops.constant(dtype=...) nor ov.Type("u8"): both give u64 here
        return ov.op.Constant(getattr(ov.Type, etype), ov.Shape(list(a.shape)), a.reshape(-1).tolist())

    w = ops.convert(low_bit(q), "f16")
    w = ops.subtract(w, ops.convert(low_bit(zp), "f16"))
    w = ops.multiply(w, ops.constant(scale))
    if group:
        w = ops.reshape(w, ops.constant(np.array([rows, cols], np.int64)), False)
    w = ops.convert(w, "f32") if to_f32 else w
    y = ops.matmul(x if to_f32 else ops.convert(x, "f16"), w, False, True)
    model = ov.Model([y], [x], "decompression")
    exact = ((q - zp).astype(np.float32) * scale.astype(np.float32)).reshape(rows, cols)
    return model, r.standard_normal((1, cols)).astype(np.float32), exact


@pytest.mark.parametrize("etype,group", [("u8", None), ("i8", None), ("u4", 16), ("i4", 16), ("u4", None)])
def test_weight_decompression_computes_in_f32_as_openvino_cpu(etype, group):
    """NNCF's f16 scales: OpenVINO CPU (f32) dequantizes without rounding (q - zp) * scale to
    f16; rounding it would move these logits by ~1e-3 and fail every compressed model's check."""
    model, x, exact = _decompressed_matmul(etype, group)
    got = Interpreter(model).run({"x": x})[model.outputs[0].get_any_name()]
    cpu = open_session(model, "openvino").infer({"x": x})[model.outputs[0].get_any_name()]
    np.testing.assert_allclose(got, x @ exact.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, cpu, rtol=1e-5, atol=1e-5)
    rounded = x @ exact.astype(np.float16).astype(np.float32).T
    assert np.abs(got - rounded).max() > 1e-4  # the case would catch f16 rounding


def test_f16_decompression_used_in_f16_stays_f16():
    """Only a subgraph that ends in a Convert to f32 is widened; an f16 consumer sees f16 weights."""
    model, _, _ = _decompressed_matmul("u8", None, to_f32=False)
    from kvc.runtime.interpreter import decompression_nodes

    assert decompression_nodes(model) == (set(), set())


@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_widened_the_interpreter_rounds_nothing_at_the_kv_boundary(kv):
    """`widen` computes a static model as if its cache were f32: a past input of f16 or bf16
    takes f32 values as they are, and a present output is not rounded (kv-io's conversions);
    without it both are rounded. The model's own arithmetic at a reduced type stays rounded
    (Falcon's ALiBi positions at bf16: OpenVINO CPU at f32 rounds them as the source model
    does, and unrounded they are another function past 256 positions; a host whose CPU does
    not round bf16 computes them unrounded, and so does the interpreter there, `cpu_rounds_bf16`)."""
    etype = {"f16": ov.Type.f16, "bf16": ov.Type.bf16}[kv]
    x = ops.parameter([4], ov.Type.f32, name="x")
    past = ops.parameter([4], etype, name="past")
    own = ops.convert(ops.convert(x, ov.Type.bf16), ov.Type.f32)  # the model's own rounding
    present = ops.convert(ops.multiply(own, ops.constant(np.float32(1 / 3))), etype)
    total = ops.add(own, ops.convert(past, ov.Type.f32))
    model = ov.Model([total.output(0), present.output(0)], [x, past])
    model.output(0).get_tensor().set_names({"y"})
    model.output(1).get_tensor().set_names({"present"})
    values = np.array([1.0, 2.0, 515.0, 1e-3], np.float32)
    rounded = round_to_bf16(values) if cpu_rounds_bf16() else values
    third = np.array([0.1, 0.2, 0.3, 0.4], np.float32) / np.float32(3)
    wide, narrow = Interpreter(model, widen=True), Interpreter(model)
    got = wide.run({"x": values, "past": third})
    np.testing.assert_allclose(got["y"], rounded + third, rtol=1e-6)
    np.testing.assert_allclose(got["present"], rounded / np.float32(3), rtol=1e-6)
    narrowed = narrow.run({"x": values, "past": third})
    assert np.abs(narrowed["present"] - rounded / np.float32(3)).max() > 1e-5
    if kv == "f16":  # a bf16 input is given in kvc's representation of bf16 (f32), read as it is
        assert np.abs(narrowed["y"] - (rounded + third)).max() > 1e-5
