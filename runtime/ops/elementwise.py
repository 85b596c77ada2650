"""Elementwise ops: binary arithmetic, comparison, logic, bitwise, unary math, activations.

Binary ops broadcast with numpy rules (`auto_broadcast=numpy`, OpenVINO's default) or
require equal shapes (`none`). Integer arithmetic wraps like C's fixed-width integers, as
OpenVINO's does; integer Divide truncates toward zero unless `m_pythondiv` asks for floor.
f16 ops compute in f32 and round once, at the output (`wide`; kernels of other families too).
"""

from __future__ import annotations

import numpy as np

from kvc.runtime.ops.registry import NodeSpec, register


def wide(x: np.ndarray) -> np.ndarray:
    """f16 values as f32: an f16 op computes in f32 and rounds once, at its output, as OpenVINO
    does at f32 inference precision (numpy would round every intermediate and overflow e^x)."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _binary(op_type: str, fn, *versions: str):
    @register(op_type, *versions)
    def factory(spec: NodeSpec):
        mode = str(spec.attrs.get("auto_broadcast", "numpy")).lower()
        out = spec.out_dtype
        f = (lambda a, b: fn(wide(a), wide(b))) if np.dtype(np.float16) in spec.input_types else fn
        if mode == "none":
            def run(a, b):
                if a.shape != b.shape:
                    raise ValueError(f"auto_broadcast=none needs equal shapes, got {a.shape} and {b.shape}")
                return np.asarray(f(a, b), dtype=out)
        elif mode == "numpy":
            def run(a, b):
                return np.asarray(f(a, b), dtype=out)
        else:
            raise NotImplementedError(f"{op_type} with auto_broadcast={mode}")
        return run

    return factory


def _is_int(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.integer)


def _divide(spec_pythondiv: bool):
    def div(a, b):
        if not _is_int(a):
            return np.divide(a, b)
        safe = np.where(b == 0, 1, b)
        if spec_pythondiv:
            q = np.floor_divide(a, safe)
        else:
            q = np.floor_divide(a, safe)
            # floor -> truncation toward zero where the signs differ and the division is inexact
            q = q + ((np.remainder(a, safe) != 0) & ((a < 0) != (safe < 0)))
        return np.where(b == 0, 0, q)
    return div


@register("Divide")
def divide(spec: NodeSpec):
    fn = _divide(bool(spec.attrs.get("m_pythondiv", True)))
    out = spec.out_dtype
    return lambda a, b: np.asarray(fn(a, b), dtype=out)


def _power(a, b):
    if _is_int(a) and _is_int(b):
        neg = b < 0
        if np.any(neg):  # an integer to a negative power: 1, -1 or 0 after truncation
            res = np.power(a, np.where(neg, 0, b))
            inv = np.where(np.abs(a) == 1, np.where((np.abs(b) % 2 == 1) & (a == -1), -1, 1), 0)
            return np.where(neg, inv, res)
    return np.power(a, b)


def _mod(a, b):  # C fmod: the result has the sign of the dividend
    if _is_int(a):
        safe = np.where(b == 0, 1, b)
        return np.where(b == 0, 0, np.fmod(a, safe))
    return np.fmod(a, b)


def _floor_mod(a, b):  # the result has the sign of the divisor
    if _is_int(a):
        safe = np.where(b == 0, 1, b)
        return np.where(b == 0, 0, np.mod(a, safe))
    return np.mod(a, b)


_binary("Add", np.add)
_binary("Subtract", np.subtract)
_binary("Multiply", np.multiply)
_binary("Maximum", np.maximum)
_binary("Minimum", np.minimum)
_binary("Power", _power)
_binary("Mod", _mod)
_binary("FloorMod", _floor_mod)
_binary("SquaredDifference", lambda a, b: np.square(np.subtract(a, b)))
_binary("Equal", np.equal)
_binary("NotEqual", np.not_equal)
_binary("Less", np.less)
_binary("LessEqual", np.less_equal)
_binary("Greater", np.greater)
_binary("GreaterEqual", np.greater_equal)
_binary("LogicalAnd", np.logical_and)
_binary("LogicalOr", np.logical_or)
_binary("LogicalXor", np.logical_xor)
_binary("BitwiseAnd", np.bitwise_and)
_binary("BitwiseOr", np.bitwise_or)
_binary("BitwiseXor", np.bitwise_xor)


def _shift(fn):
    def run(a, b):
        bits = a.dtype.itemsize * 8
        out = fn(a, np.clip(b, 0, bits - 1).astype(a.dtype))
        return np.where((b < 0) | (b >= bits), 0, out)
    return run


_binary("BitwiseLeftShift", _shift(np.left_shift))
_binary("BitwiseRightShift", _shift(np.right_shift))


def _unary(op_type: str, fn, *versions: str):
    @register(op_type, *versions)
    def factory(spec: NodeSpec):
        out = spec.out_dtype
        return lambda x: np.asarray(fn(wide(x)), dtype=out)

    return factory


def erf(x: np.ndarray) -> np.ndarray:
    """erf with fractional error < 1.2e-7 (Numerical Recipes' erfc Chebyshev fit), in float64;
    numpy has no erf and kvc does not depend on scipy."""
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = (-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277)))))))))
    erfc = t * np.exp(poly)
    return np.where(x >= 0, 1.0 - erfc, erfc - 1.0)


def _round_half_away(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


_unary("Abs", np.abs)
_unary("Negative", np.negative)
_unary("Sqrt", np.sqrt)
_unary("Exp", np.exp)
_unary("Log", np.log)
_unary("Sin", np.sin)
_unary("Cos", np.cos)
_unary("Tan", np.tan)
_unary("Tanh", np.tanh)
_unary("Asin", np.arcsin)
_unary("Acos", np.arccos)
_unary("Atan", np.arctan)
_unary("Sinh", np.sinh)
_unary("Cosh", np.cosh)
_unary("Asinh", np.arcsinh)
_unary("Acosh", np.arccosh)
_unary("Atanh", np.arctanh)
_unary("Erf", lambda x: erf(x) if not _is_int(x) else np.round(erf(x)))
_unary("Floor", lambda x: x if _is_int(x) else np.floor(x))
_unary("Ceiling", lambda x: x if _is_int(x) else np.ceil(x))
_unary("Sign", np.sign)
_unary("LogicalNot", np.logical_not)
_unary("BitwiseNot", lambda x: np.logical_not(x) if x.dtype == np.bool_ else np.invert(x))
_unary("IsNaN", np.isnan)
_unary("Relu", lambda x: np.maximum(x, 0))
_unary("Sigmoid", lambda x: 1.0 / (1.0 + np.exp(-x)))
_unary("HSwish", lambda x: x * np.clip(x + 3.0, 0.0, 6.0) / 6.0)
_unary("HSigmoid", lambda x: np.clip(x + 3.0, 0.0, 6.0) / 6.0)
_unary("SoftSign", lambda x: x / (1.0 + np.abs(x)))


def softplus(x):
    """log(1 + e^x), without overflow for large x (OpenVINO returns x above the threshold)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


_unary("SoftPlus", softplus)
_unary("Mish", lambda x: x * np.tanh(softplus(x)))


@register("IsInf")
def is_inf(spec: NodeSpec):
    pos, neg = bool(spec.attrs.get("detect_positive", True)), bool(spec.attrs.get("detect_negative", True))
    return lambda x: (np.isposinf(x) & pos) | (np.isneginf(x) & neg)


@register("IsFinite")
def is_finite(spec: NodeSpec):
    return np.isfinite


@register("Round")
def round_(spec: NodeSpec):
    mode = str(spec.attrs.get("mode", "half_to_even")).lower()
    out = spec.out_dtype
    fn = np.round if mode == "half_to_even" else _round_half_away
    return lambda x: x if _is_int(x) else np.asarray(fn(x), dtype=out)


@register("Clamp")
def clamp(spec: NodeSpec):
    lo, hi = float(spec.attrs["min"]), float(spec.attrs["max"])
    out = spec.out_dtype
    if np.issubdtype(out, np.integer):  # integer clamp bounds round inward
        lo, hi = np.ceil(lo), np.floor(hi)
    return lambda x: np.asarray(np.clip(x, lo, hi), dtype=out)


@register("Gelu")
def gelu(spec: NodeSpec):
    mode = str(spec.attrs.get("approximation_mode", "erf")).lower()
    out = spec.out_dtype
    if mode == "tanh":
        c = np.sqrt(2.0 / np.pi)
        return lambda x: np.asarray(0.5 * wide(x) * (1.0 + np.tanh(c * (wide(x) + 0.044715 * wide(x) ** 3))),
                                    dtype=out)
    return lambda x: np.asarray(0.5 * wide(x) * (1.0 + erf(wide(x) / np.sqrt(2.0))), dtype=out)


@register("Swish")
def swish(spec: NodeSpec):
    out = spec.out_dtype

    def run(x, beta=None):
        b = 1.0 if beta is None else wide(beta)
        return np.asarray(wide(x) / (1.0 + np.exp(-b * wide(x))), dtype=out)

    return run


@register("Elu")
def elu(spec: NodeSpec):
    alpha = float(spec.attrs["alpha"])
    out = spec.out_dtype
    return lambda x: np.asarray(np.where(x > 0, x, alpha * (np.exp(x) - 1.0)), dtype=out)


@register("Selu")
def selu(spec: NodeSpec):
    out = spec.out_dtype
    return lambda x, alpha, lam: np.asarray(lam * np.where(x > 0, x, alpha * (np.exp(x) - 1.0)), dtype=out)


@register("PRelu")
def prelu(spec: NodeSpec):
    out = spec.out_dtype

    def run(x, slope):
        if slope.ndim == 1 and x.ndim >= 2 and slope.shape[0] == x.shape[1] and slope.shape[0] != x.shape[-1]:
            slope = slope.reshape((1, -1) + (1,) * (x.ndim - 2))  # per-channel slope
        return np.asarray(np.where(x < 0, x * slope, x), dtype=out)

    return run


@register("HardSigmoid")
def hard_sigmoid(spec: NodeSpec):
    out = spec.out_dtype
    return lambda x, alpha, beta: np.asarray(np.clip(alpha * x + beta, 0.0, 1.0), dtype=out)


@register("Select")
def select(spec: NodeSpec):
    out = spec.out_dtype
    return lambda cond, a, b: np.asarray(np.where(cond, a, b), dtype=out)
