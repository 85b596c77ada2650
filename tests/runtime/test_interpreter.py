"""The interpreter's contract: unsupported ops listed up front, errors with context, trace and
capture modes, state like OpenVINO's query_state, clear input errors."""

from __future__ import annotations


import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.runtime.interpreter import EvaluationError, InputError, Interpreter, UnsupportedOpError, check_supported
from kvc.runtime.session import open_session
from tests.passes.models import counter_model


def test_unsupported_ops_are_all_listed_before_running():
    x = ops.parameter([4, 4], np.float32, name="x")
    x.output(0).set_names({"x"})
    rolled = ops.roll(x, ops.constant(np.array([1], np.int64)), ops.constant(np.array([0], np.int64)), name="roll")
    where = ops.non_zero(ops.relu(rolled, name="relu"), name="nz")
    model = ov.Model([where, rolled], [x], "m")
    with pytest.raises(UnsupportedOpError) as info:
        check_supported(model)
    text = str(info.value)
    assert "does not implement 2 op type(s)" in text
    assert "NonZero (opset3) ×1: 'nz'" in text and "Roll (opset7) ×1: 'roll'" in text
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
