"""A NaN in a model's weights is found wherever it is (kvc.ir.finite), in every float type
and in an If's bodies; -Inf (a mask's fill value) is not a NaN."""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as ops

from kvc.errors import InvalidModelError
from kvc.ir.finite import check_no_nan_weights, nan_count


def model_with(constant) -> ov.Model:
    x = ops.parameter(constant.get_output_shape(0), constant.get_output_element_type(0))
    return ov.Model([ops.add(x, constant)], [x])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_nan_in_a_float_constant_is_counted_and_named(dtype):
    values = np.zeros((4, 8), dtype)
    values[2, 3] = values[3, 7] = np.nan
    const = ops.constant(values)
    const.set_friendly_name("lm_head.weight")
    assert nan_count(const) == 2
    with pytest.raises(InvalidModelError) as err:
        check_no_nan_weights(model_with(const), "model.xml")
    assert err.value.code == "nan-weights" and err.value.layer == "lm_head.weight"
    assert err.value.found == "2 NaN of 32" and err.value.exit_code == 3


def test_bf16_nans_are_found_in_their_bits_and_infinities_are_not_nans():
    assert nan_count(ov.op.Constant(ov.Type.bf16, ov.Shape([3]), [1.0, float("nan"), -np.inf])) == 1
    masked = ops.constant(np.array([0.0, -np.inf, np.inf], np.float32))
    assert nan_count(masked) == 0
    check_no_nan_weights(model_with(masked), "model.xml")  # no error
    assert nan_count(ops.constant(np.array([1, 2], np.int64))) == 0


def test_a_nan_inside_an_if_body_is_found():
    x, cond = ops.parameter([2], np.float32), ops.parameter([], ov.Type.boolean)

    def body(values):
        p = ops.parameter([2], np.float32)
        r = ops.result(ops.add(p, ops.constant(np.array(values, np.float32))))
        return ov.Model([r], [p]), p, r

    (then, tp, tr), (other, ep, er) = body([1.0, np.nan]), body([1.0, 2.0])
    branch = ops.if_op(cond)
    branch.set_then_body(then)
    branch.set_else_body(other)
    branch.set_input(x.output(0), tp, ep)
    model = ov.Model([branch.set_output(tr, er)], [x, cond])
    with pytest.raises(InvalidModelError, match="1 NaN of 2"):
        check_no_nan_weights(model, "model.xml")


def test_a_nan_inside_a_loop_body_is_found():
    """A Loop's `get_function` takes no index: the walk crashed (exit 1, an internal error) on
    every model with one, as a Mamba layer's scan (granitemoehybrid) has."""
    x = ops.parameter([2], np.float32)
    p, count, cond = ops.parameter([2], np.float32), ops.parameter([], np.int64), ops.parameter([], ov.Type.boolean)
    body_out = ops.result(ops.multiply(p, ops.constant(np.array([2.0, np.nan], np.float32))))
    body = ov.Model([body_out, ops.result(ops.constant(True))], [p, count, cond])
    loop = ops.loop(ops.constant(np.int64(3)), ops.constant(True))
    loop.set_function(body)
    loop.set_special_body_ports([-1, 1])
    loop.set_merged_input(p, x.output(0), body_out.output(0))
    model = ov.Model([loop.get_iter_value(body_out.output(0), -1)], [x])
    with pytest.raises(InvalidModelError, match="1 NaN of 2"):
        check_no_nan_weights(model, "model.xml")
