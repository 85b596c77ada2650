"""Elementwise ops: kvc's interpreter against OpenVINO CPU (f32) on random inputs.

Binary arithmetic, comparison, logical and bitwise ops; unary math; activations; Select.
Where OpenVINO CPU departs from the op specification, the test pins the spec's answer (and,
where it has one, OpenVINO core's reference `evaluate`, which agrees) and names the departure
in a one-line comment: i64 arithmetic and bitwise ops computed in i32, saturating 8-bit
arithmetic, an all-zero 8-bit SquaredDifference, integer Divide ignoring `m_pythondiv`, NaN > x
true, a truncated u8 Clamp bound.
"""

from __future__ import annotations

import numpy as np
import openvino.opset15 as ops
import pytest
from openvino.utils.node_factory import NodeFactory

from tests.runtime.op_harness import check, check_expected, ov_reference, randint, randn, rng

I32_MAX, I32_MIN = np.iinfo(np.int32).max, np.iinfo(np.int32).min
I64_MAX, I64_MIN = np.iinfo(np.int64).max, np.iinfo(np.int64).min

# Shapes that exercise numpy broadcasting both ways, a scalar, and an empty dimension.
SHAPES = [((2, 3, 4), (2, 3, 4)), ((2, 1, 4), (3, 1)), ((), (2, 3)), ((0, 3), (1, 3))]
SHAPE_IDS = ["same", "bcast", "scalar", "empty"]


def _ints(seed, shape, dtype, lo=-50, hi=50, nonzero=False):
    a = randint(seed, shape, lo, hi, dtype)
    if nonzero:
        a = np.where(a == 0, 1, a).astype(dtype)
    return a


# -- binary arithmetic ------------------------------------------------------------------------
ARITH = {
    "Add": ops.add, "Subtract": ops.subtract, "Multiply": ops.multiply, "Maximum": ops.maximum,
    "Minimum": ops.minimum, "SquaredDifference": ops.squared_difference,
}


@pytest.mark.parametrize("shapes", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64, np.int8, np.uint8])
@pytest.mark.parametrize("op", ARITH)
def test_binary_arithmetic(op, dtype, shapes):
    sa, sb = shapes
    if np.issubdtype(dtype, np.floating):
        a, b = randn(1, sa, dtype, 3.0), randn(2, sb, dtype, 3.0)
    elif np.dtype(dtype).itemsize == 1:  # no overflow here: test_8bit_arithmetic_wraps covers it
        a, b = _ints(1, sa, dtype, 8, 11), _ints(2, sb, dtype, 0, 8)
    else:
        a, b = _ints(1, sa, dtype, -50, 50), _ints(2, sb, dtype, -50, 50)
    make = lambda x, y: ARITH[op](x, y)  # noqa: E731
    if op == "SquaredDifference" and np.dtype(dtype).itemsize == 1 and a.size and b.size:
        # OpenVINO CPU returns all zeros for an 8-bit SquaredDifference; the spec says (a - b)**2.
        check_expected(make, {"x": a, "y": b}, np.square(np.subtract(a, b, dtype=dtype), dtype=dtype))
    else:
        check(make, {"x": a, "y": b})


def test_binary_auto_broadcast_none():
    a, b = randn(3, (2, 3)), randn(4, (2, 3))
    check(lambda x, y: ops.add(x, y, auto_broadcast="none"), {"x": a, "y": b})


@pytest.mark.parametrize("op", ["Add", "Subtract", "Multiply"])
def test_i32_arithmetic_wraps(op):
    a = np.array([I32_MAX, I32_MIN, I32_MAX, 1 << 30, -(1 << 30), 46341], np.int32)
    b = np.array([1, -1, I32_MAX, 4, 3, 46341], np.int32)
    check(lambda x, y: ARITH[op](x, y), {"x": a, "y": b})


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("op,fn", [("Add", np.add), ("Subtract", np.subtract), ("Multiply", np.multiply)])
def test_8bit_arithmetic_wraps(op, fn, dtype):
    a = np.array([200, 100, 17, 3, 255, 0], np.uint8).astype(dtype)
    b = np.array([3, 200, 15, 5, 255, 1], np.uint8).astype(dtype)
    with np.errstate(over="ignore"):
        expected = fn(a, b)
    # OpenVINO CPU saturates 8-bit Add/Subtract/Multiply (200 - 3 ... 100 - 200 -> 0); spec and core reference wrap.
    if op != "Multiply":  # core has no reference Multiply for 8-bit types
        assert np.array_equal(ov_reference(lambda x, y: ARITH[op](x, y), {"x": a, "y": b})[0], expected)
    check_expected(lambda x, y: ARITH[op](x, y), {"x": a, "y": b}, expected)


@pytest.mark.parametrize("op,fn", [("Add", np.add), ("Subtract", np.subtract), ("Multiply", np.multiply)])
def test_i64_arithmetic_wraps(op, fn):
    a = np.array([I64_MAX, I64_MIN, 1 << 62, 3_000_000_000, -(1 << 40)], np.int64)
    b = np.array([1, 1, 4, 5_000_000_000, 1 << 30], np.int64)
    with np.errstate(over="ignore"):
        expected = fn(a, b)  # numpy int64 arithmetic wraps modulo 2**64
    # OpenVINO CPU computes i64 arithmetic in i32 (3e9 + 5e9 comes out wrong); spec and core reference wrap in 64 bits.
    assert np.array_equal(ov_reference(lambda x, y: ARITH[op](x, y), {"x": a, "y": b})[0], expected)
    check_expected(lambda x, y: ARITH[op](x, y), {"x": a, "y": b}, expected)


@pytest.mark.parametrize("shapes", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_divide_float(dtype, shapes):
    a, b = randn(5, shapes[0], dtype, 3.0), randn(6, shapes[1], dtype, 3.0)
    check(lambda x, y: ops.divide(x, y), {"x": a, "y": b})


def _divide(pythondiv):
    def make(x, y):
        node = ops.divide(x, y)
        node.set_attribute("m_pythondiv", pythondiv)
        return node
    return make


DIV_A = np.array([7, -7, 7, -7, 6, -6, 0, 1, -1, 100, I32_MIN], np.int32)
DIV_B = np.array([2, 2, -2, -2, 3, 3, 5, 7, 7, -9, -1], np.int32)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_divide_int_truncating(dtype):
    a, b = DIV_A.astype(dtype), DIV_B.astype(dtype)
    a = a[:-1] if dtype == np.int64 else a  # I32_MIN / -1 wraps in i32 only
    b = b[:len(a)]
    check(_divide(False), {"x": a, "y": b})
    check(_divide(False), {"x": _ints(7, (3, 4), dtype), "y": _ints(8, (4,), dtype, nonzero=True)})


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_divide_int_python_division_floors(dtype):
    a, b = DIV_A[:-1].astype(dtype), DIV_B[:-1].astype(dtype)
    expected = np.floor_divide(a, b)
    # OpenVINO CPU truncates integer Divide even with m_pythondiv=true; the spec and core reference floor.
    assert np.array_equal(ov_reference(_divide(True), {"x": a, "y": b})[0], expected)
    check_expected(_divide(True), {"x": a, "y": b}, expected)


def test_divide_uint_and_i32_overflow():
    check(_divide(True), {"x": np.array([7, 200, 0, 255], np.uint8), "y": np.array([2, 3, 9, 16], np.uint8)})
    check(_divide(False), {"x": np.array([I32_MIN], np.int32), "y": np.array([-1], np.int32)})


@pytest.mark.parametrize("op", ["Mod", "FloorMod"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_mod(op, dtype):
    fn = ops.mod if op == "Mod" else ops.floor_mod
    if dtype == np.float32:
        a, b = randn(9, (3, 4), dtype, 10.0), randn(10, (4,), dtype, 3.0)
        b = np.where(np.abs(b) < 0.1, 1.0, b).astype(dtype)
    else:
        a, b = _ints(9, (3, 4), dtype, -40, 40), _ints(10, (4,), dtype, -7, 7, nonzero=True)
    check(lambda x, y: fn(x, y), {"x": a, "y": b})
    signs = np.array([7, -7, 7, -7, 6, -6], dtype), np.array([3, 3, -3, -3, 3, -3], dtype)
    check(lambda x, y: fn(x, y), {"x": signs[0], "y": signs[1]})


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_power_float(dtype):
    a = np.abs(randn(11, (3, 4), dtype, 2.0)) + dtype(0.1)
    b = randn(12, (4,), dtype, 2.0)
    check(lambda x, y: ops.power(x, y), {"x": a, "y": b})
    neg_base = np.array([-2.0, -1.5, -3.0, 0.0, 2.0], dtype)
    int_exp = np.array([2.0, 3.0, -1.0, 2.0, 0.5], dtype)
    check(lambda x, y: ops.power(x, y), {"x": neg_base, "y": int_exp})


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_power_int(dtype):
    a = _ints(13, (3, 5), dtype, -6, 7)
    b = _ints(14, (5,), dtype, 0, 6)
    check(lambda x, y: ops.power(x, y), {"x": a, "y": b})


def test_power_int_negative_exponent():
    a = np.array([2, -2, 1, -1, -1, 3], np.int32)
    b = np.array([-1, -1, -3, -3, -2, -2], np.int32)
    check(lambda x, y: ops.power(x, y), {"x": a, "y": b})


# -- comparison, logical, bitwise -------------------------------------------------------------
COMPARE = {
    "Equal": ops.equal, "NotEqual": ops.not_equal, "Less": ops.less, "LessEqual": ops.less_equal,
    "Greater": ops.greater, "GreaterEqual": ops.greater_equal,
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64])
@pytest.mark.parametrize("op", COMPARE)
def test_comparison(op, dtype):
    a = _ints(15, (2, 3, 4), np.int32, -3, 3).astype(dtype)  # small values: many ties
    b = _ints(16, (3, 1), np.int32, -3, 3).astype(dtype)
    check(lambda x, y: COMPARE[op](x, y), {"x": a, "y": b})
    check(lambda x, y: COMPARE[op](x, y), {"x": np.zeros((0, 4), dtype), "y": b[:1, :1]})


NAN_A = np.array([np.nan, 1.0, np.nan, np.inf, -np.inf, -0.0], np.float32)
NAN_B = np.array([np.nan, np.nan, 1.0, np.inf, 0.0, 0.0], np.float32)
NUMPY_COMPARE = {"Equal": np.equal, "NotEqual": np.not_equal, "Less": np.less, "LessEqual": np.less_equal,
                 "Greater": np.greater, "GreaterEqual": np.greater_equal}


@pytest.mark.parametrize("op", COMPARE)
def test_comparison_nan(op):
    make = lambda x, y: COMPARE[op](x, y)  # noqa: E731
    inputs = {"x": NAN_A, "y": NAN_B}
    if op in ("Greater", "GreaterEqual"):
        # OpenVINO CPU answers true for NaN > x and NaN >= x; IEEE 754 and core reference say false.
        expected = NUMPY_COMPARE[op](NAN_A, NAN_B)
        assert np.array_equal(ov_reference(make, inputs)[0], expected)
        check_expected(make, inputs, expected)
    else:
        check(make, inputs)


LOGICAL = {"LogicalAnd": ops.logical_and, "LogicalOr": ops.logical_or, "LogicalXor": ops.logical_xor}


@pytest.mark.parametrize("op", LOGICAL)
def test_logical_binary(op):
    a = rng(17).random((2, 3, 4)) < 0.5
    b = rng(18).random((3, 1)) < 0.5
    check(lambda x, y: LOGICAL[op](x, y), {"x": a, "y": b})


def test_logical_not():
    check(lambda x: ops.logical_not(x), {"x": rng(19).random((3, 5)) < 0.5})


BITWISE = {"BitwiseAnd": ops.bitwise_and, "BitwiseOr": ops.bitwise_or, "BitwiseXor": ops.bitwise_xor}


def _full_range(seed, shape, dtype):
    """Random values over the whole range of an integer type (i64 limited to i32's: see below)."""
    if dtype == np.bool_:
        return rng(seed).random(shape) < 0.5
    info = np.iinfo(np.int32 if dtype == np.int64 else dtype)
    return rng(seed).integers(info.min, info.max, shape, endpoint=True).astype(dtype)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8, np.uint8, np.uint16, np.bool_])
@pytest.mark.parametrize("op", BITWISE)
def test_bitwise_binary(op, dtype):
    check(lambda x, y: BITWISE[op](x, y), {"x": _full_range(20, (3, 4), dtype), "y": _full_range(21, (4,), dtype)})


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8, np.uint8, np.uint16, np.bool_])
def test_bitwise_not(dtype):
    check(lambda x: ops.bitwise_not(x), {"x": _full_range(22, (3, 4), dtype)})


BIG_I64 = np.array([I64_MAX, I64_MIN, 0x0123_4567_89AB_CDEF, -0x7654_3210_FEDC_BA98, 1 << 40, -1], np.int64)


@pytest.mark.parametrize("op,fn", [("BitwiseAnd", np.bitwise_and), ("BitwiseOr", np.bitwise_or),
                                   ("BitwiseXor", np.bitwise_xor), ("BitwiseNot", np.invert)])
def test_bitwise_i64_high_bits(op, fn):
    b = BIG_I64[::-1].copy()
    if op == "BitwiseNot":
        make, inputs, expected = (lambda x: ops.bitwise_not(x)), {"x": BIG_I64}, np.invert(BIG_I64)
    else:
        make, inputs, expected = (lambda x, y: BITWISE[op](x, y)), {"x": BIG_I64, "y": b}, fn(BIG_I64, b)
    # OpenVINO CPU computes i64 bitwise ops in i32 and drops the high 32 bits; the spec keeps all 64.
    check_expected(make, inputs, expected)


SHIFTS = {"BitwiseLeftShift": ops.bitwise_left_shift, "BitwiseRightShift": ops.bitwise_right_shift}


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8, np.uint8, np.uint16])
@pytest.mark.parametrize("op", SHIFTS)
def test_bitwise_shift(op, dtype):
    # Shifts by a negative amount or by the bit width or more are undefined (spec): not tested.
    bits = 32 if dtype == np.int64 else np.dtype(dtype).itemsize * 8
    a = _full_range(23, (4, 6), dtype)
    if op == "BitwiseLeftShift" and dtype == np.int64:
        a = (a >> 32).astype(dtype)  # keep i64 results inside i32: CPU computes i64 in i32 (next test)
    b = rng(24).integers(0, bits, (6,)).astype(dtype)
    check(lambda x, y: SHIFTS[op](x, y), {"x": a, "y": b})


@pytest.mark.parametrize("op,fn", [("BitwiseLeftShift", np.left_shift), ("BitwiseRightShift", np.right_shift)])
def test_bitwise_shift_i64_high_bits(op, fn):
    b = np.array([1, 63, 4, 35, 20, 0], np.int64)
    expected = fn(BIG_I64, b)
    make, inputs = (lambda x, y: SHIFTS[op](x, y)), {"x": BIG_I64, "y": b}
    # OpenVINO CPU shifts i64 in i32 and drops the high 32 bits; the spec shifts all 64.
    check_expected(make, inputs, expected)


# -- unary math -------------------------------------------------------------------------------
def _positive(seed, shape, dtype):
    return (np.abs(randn(seed, shape, np.float32, 3.0)) + 0.05).astype(dtype)


# op -> (opset function, input maker). Transcendental ops meet the default f32 tolerance on these
# ranges although the CPU plugin evaluates its own polynomial approximations and numpy uses libm.
UNARY = {
    "Abs": (ops.abs, randn), "Negative": (ops.negative, randn), "Sqrt": (ops.sqrt, _positive),
    "Exp": (ops.exp, randn), "Log": (ops.log, _positive), "Sin": (ops.sin, randn), "Cos": (ops.cos, randn),
    "Tanh": (ops.tanh, randn), "Erf": (ops.erf, randn), "Floor": (ops.floor, randn),
    "Ceiling": (ops.ceiling, randn), "Sign": (ops.sign, randn),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op", UNARY)
def test_unary_float(op, dtype):
    fn, gen = UNARY[op]
    x = gen(25, (3, 4, 5), dtype) if gen is _positive else gen(25, (3, 4, 5), dtype, 3.0)
    if op in ("Floor", "Ceiling", "Sign"):
        x = np.concatenate([x.reshape(-1), np.array([-0.0, 0.0, 2.0, -2.0, 0.5, -0.5], dtype)])
    check(lambda x: fn(x), {"x": x})
    check(lambda x: fn(x), {"x": np.zeros((2, 0), dtype)})


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("op", ["Abs", "Negative", "Sign", "Floor", "Ceiling"])
def test_unary_int(op, dtype):
    x = _ints(26, (4, 5), dtype, -100, 100)
    check(lambda x: UNARY[op][0](x), {"x": x})


def test_unary_int_wraps():
    x = np.array([I32_MIN, I32_MAX, 0, -1], np.int32)
    check(lambda x: ops.abs(x), {"x": x})
    check(lambda x: ops.negative(x), {"x": x})


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("lo,hi", [(-1.0, 1.0), (0.5, 0.5), (-0.25, 2.75)])
def test_clamp_float(dtype, lo, hi):
    check(lambda x: ops.clamp(x, lo, hi), {"x": randn(27, (3, 7), dtype, 2.0)})


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("lo,hi", [(-3.0, 4.0), (-2.5, 3.5), (0.2, 5.8), (1.5, 250.7)])
def test_clamp_int(dtype, lo, hi):
    # The spec rounds integer bounds inward: ceil(min), floor(max). (min > max is undefined: not tested.)
    x = _ints(28, (4, 6), dtype, 0 if dtype == np.uint8 else -8, 8)
    if dtype == np.uint8:
        x = np.concatenate([x.reshape(-1), np.array([255, 0, 1, 251], np.uint8)])
    make = lambda x: ops.clamp(x, lo, hi)  # noqa: E731
    if dtype == np.uint8 and lo > 0 and lo != int(lo):
        expected = np.clip(x, np.ceil(lo), np.floor(hi)).astype(dtype)
        # OpenVINO CPU truncates a u8 Clamp's fractional min (1.5 -> 1); the spec (ceil) and core reference don't.
        assert np.array_equal(ov_reference(make, {"x": x})[0], expected)
        check_expected(make, {"x": x}, expected)
    else:
        check(make, {"x": x})


# -- activations ------------------------------------------------------------------------------
ACTIVATIONS = {
    "Relu": lambda x: ops.relu(x),
    "Sigmoid": lambda x: ops.sigmoid(x),
    "SoftPlus": lambda x: ops.softplus(x),
    "HSwish": lambda x: ops.hswish(x),
    "Mish": lambda x: ops.mish(x),
    "GeluErf": lambda x: ops.gelu(x, "erf"),
    "GeluTanh": lambda x: ops.gelu(x, "tanh"),
    "Swish": lambda x: NodeFactory("opset4").create("Swish", [x.output(0)], {}),  # ops.swish adds beta=1.0
    "SwishBeta": lambda x: ops.swish(x, np.array(0.75, x.get_element_type().to_dtype())),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op", ACTIVATIONS)
def test_activation(op, dtype):
    x = randn(29, (2, 3, 16), dtype, 4.0)
    x = np.concatenate([x.reshape(-1), np.array([0.0, -3.0, 3.0, -30.0, 30.0, 19.5, 20.5], dtype)])
    check(ACTIVATIONS[op], {"x": x})


def test_swish_beta_as_parameter():
    check(lambda x, beta: ops.swish(x, beta), {"x": randn(30, (3, 8)), "beta": np.array(1.7, np.float32)})


# -- Select -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shapes", [((2, 3, 4), (2, 3, 4), (2, 3, 4)), ((3, 1), (1, 4), (2, 1, 1)),
                                    ((4,), (), (3, 4)), ((0, 4), (4,), ())],
                         ids=["same", "bcast", "scalar", "empty"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_select(dtype, shapes):
    sc, sa, sb = shapes
    cond = rng(31).random(sc) < 0.5
    if dtype == np.bool_:
        a, b = rng(32).random(sa) < 0.5, rng(33).random(sb) < 0.5
    else:
        a, b = randn(32, sa, np.float32, 5.0).astype(dtype), randn(33, sb, np.float32, 5.0).astype(dtype)
    check(lambda c, x, y: ops.select(c, x, y), {"c": cond, "x": a, "y": b})


# -- dynamic shapes ---------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["Add", "Multiply", "Select", "Gelu", "Divide"])
def test_dynamic_shapes(op):
    # Every dimension of every Parameter dynamic: OpenVINO picks its dynamic-shape kernels.
    a, b = randn(40, (2, 1, 4)), randn(41, (3, 1))
    makes = {
        "Add": (lambda x, y: ops.add(x, y), {"x": a, "y": b}),
        "Multiply": (lambda x, y: ops.multiply(x, y), {"x": a, "y": b}),
        "Select": (lambda c, x, y: ops.select(c, x, y), {"c": rng(42).random((3, 4)) < 0.5, "x": a, "y": b}),
        "Gelu": (lambda x: ops.gelu(x, "tanh"), {"x": a}),
        "Divide": (_divide(False), {"x": _ints(43, (3, 4), np.int32), "y": _ints(44, (4,), np.int32, nonzero=True)}),
    }
    make, inputs = makes[op]
    check(make, inputs, dynamic=True)
