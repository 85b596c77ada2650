"""MatMul, Einsum and ScaledDotProductAttention: kvc's interpreter against OpenVINO CPU (f32).

The products are small (K <= 64), so f32 results meet the default tolerance although the two
sides sum in different orders.
"""

from __future__ import annotations

import numpy as np
import openvino.opset13 as opset13
import openvino.opset15 as ops
import pytest

from tests.runtime.op_harness import check, randint, randn, rng

# -- MatMul -----------------------------------------------------------------------------------
MATMULS = [  # a shape, b shape (before transposes), transpose_a, transpose_b
    ((3, 4), (4, 5), False, False), ((4, 3), (4, 5), True, False), ((3, 4), (5, 4), False, True),
    ((4, 3), (5, 4), True, True), ((2, 3, 4), (4, 5), False, False), ((2, 3, 4), (5, 4), False, True),
    ((2, 1, 3, 4), (5, 4, 6), False, False), ((1, 4, 3), (2, 4, 5), True, False), ((4,), (4, 5), False, False),
    ((3, 4), (4,), False, False), ((4,), (4,), False, False), ((2, 3, 4), (4,), False, False),
    ((4,), (2, 4, 5), False, False), ((4,), (5, 4), False, True), ((4,), (4,), True, True),
    ((3, 0), (0, 5), False, False), ((2, 0, 4), (4, 3), False, False),
]


@pytest.mark.parametrize("case", MATMULS, ids=[str(i) for i in range(len(MATMULS))])
def test_matmul(case):
    sa, sb, ta, tb = case
    check(lambda a, b: ops.matmul(a, b, ta, tb), {"a": randn(1, sa), "b": randn(2, sb)})


def test_matmul_constant_weight():
    # The interpreter's hot path: a 3-D activation times a constant 2-D weight (transposed or not).
    w = randn(3, (6, 8))
    check(lambda a: ops.matmul(a, w, False, True), {"a": randn(4, (2, 5, 8))})
    check(lambda a: ops.matmul(a, w.T.copy(), False, False), {"a": randn(4, (2, 5, 8))})


def test_matmul_f16():
    # f16 in and out, accumulated in f32 on both sides: one f16 rounding at the end.
    check(lambda a, b: ops.matmul(a, b, False, True),
          {"a": randn(5, (2, 3, 64), np.float16), "b": randn(6, (2, 7, 64), np.float16)})


def test_matmul_int():
    a, b = randint(7, (2, 3, 4), -9, 9, np.int32), randint(8, (4, 5), -9, 9, np.int32)
    check(lambda a, b: ops.matmul(a, b, False, False), {"a": a, "b": b})


# -- Einsum -----------------------------------------------------------------------------------
EINSUMS = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij->ji", [(3, 4)]),
    ("ii->i", [(4, 4)]),
    ("ij->", [(3, 4)]),
    ("i,i->", [(5,), (5,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("bhqd,bhkd->bhqk", [(1, 2, 3, 4), (1, 2, 5, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,jk->...ik", [(2, 2, 3, 4), (4, 5)]),
    ("a...,a...->...", [(3, 2, 4), (3, 2, 4)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("abc->cab", [(2, 3, 4)]),
    ("ab,ab->a", [(3, 4), (3, 4)]),
]


@pytest.mark.parametrize("equation,shapes", EINSUMS, ids=[e for e, _ in EINSUMS])
def test_einsum(equation, shapes):
    inputs = {f"x{i}": randn(10 + i, s) for i, s in enumerate(shapes)}
    check(lambda **xs: ops.einsum([xs[f"x{i}"] for i in range(len(shapes))], equation), inputs)


def test_einsum_f16():
    inputs = {"a": randn(12, (2, 3, 128), np.float16), "b": randn(13, (2, 128, 5), np.float16)}
    check(lambda a, b: ops.einsum([a, b], "bij,bjk->bik"), inputs)  # accumulated in f32, rounded once


# -- ScaledDotProductAttention ----------------------------------------------------------------
def sdpa(q, k, v, *rest, causal=False):
    return opset13.scaled_dot_product_attention(q, k, v, *rest, causal=causal)


def _qkv(seed, b=2, h=3, L=4, S=6, d=8, kv_heads=None, dtype=np.float32):
    return {"q": randn(seed, (b, h, L, d), dtype), "k": randn(seed + 1, (b, kv_heads or h, S, d), dtype),
            "v": randn(seed + 2, (b, kv_heads or h, S, d), dtype)}


@pytest.mark.parametrize("L,S", [(4, 4), (1, 6), (3, 7), (5, 5)])
def test_sdpa_plain(L, S):
    check(lambda q, k, v: sdpa(q, k, v), _qkv(20, L=L, S=S))


@pytest.mark.parametrize("L,S", [(4, 4), (1, 1), (6, 6)])
def test_sdpa_causal_square(L, S):
    check(lambda q, k, v: sdpa(q, k, v, causal=True), _qkv(21, L=L, S=S))


@pytest.mark.parametrize("L,S", [(1, 6), (3, 7)])
def test_sdpa_causal_fewer_queries_than_keys(L, S):
    check(lambda q, k, v: sdpa(q, k, v, causal=True), _qkv(22, L=L, S=S))


@pytest.mark.parametrize("shape", [(4, 6), (2, 1, 4, 6), (1, 3, 4, 6), (2, 3, 4, 6), (1, 6)], ids=str)
def test_sdpa_boolean_mask(shape):
    inputs = _qkv(23)
    mask = rng(24).random(shape) < 0.7
    mask[..., 0] = True  # every query sees at least one key (an all-false row is 0/0)
    inputs["m"] = mask
    check(lambda q, k, v, m: sdpa(q, k, v, m), inputs)


@pytest.mark.parametrize("shape", [(4, 6), (2, 1, 4, 6), (2, 3, 1, 6), (2, 3, 4, 6)], ids=str)
def test_sdpa_additive_mask(shape):
    inputs = _qkv(25)
    m = randn(26, shape, np.float32, 2.0)
    m[..., -1] = -np.inf  # masked-out keys, as an LLM's padding mask has
    inputs["m"] = m
    check(lambda q, k, v, m: sdpa(q, k, v, m), inputs)


def test_sdpa_explicit_scale():
    inputs = _qkv(27)
    inputs["m"] = np.zeros((4, 6), np.float32)
    inputs["s"] = np.array(0.37, np.float32)
    check(lambda q, k, v, m, s: sdpa(q, k, v, m, s), inputs)
    check(lambda q, k, v, m: sdpa(q, k, v, m, np.array(2.0, np.float32)), {k: inputs[k] for k in "qkvm"})


@pytest.mark.parametrize("mask_kind", ["boolean", "additive"])
def test_sdpa_sink(mask_kind):
    """Input 5 (GPT-OSS's attention sinks, [1, H, 1, 1]): one more logit per head joins the
    softmax and its column is dropped; a fully masked row then attends to nothing, not NaN."""
    from openvino._pyopenvino import NodeFactory

    inputs = _qkv(50, b=1, h=4, L=3, S=7)
    mask = rng(51).random((1, 1, 3, 7)) < 0.6
    mask[0, 0, 1] = False  # a pad row: only the sink is visible
    inputs["m"] = mask if mask_kind == "boolean" else np.where(mask, 0, -np.inf).astype(np.float32)
    sink = randn(52, (1, 4, 1, 1), scale=3.0)

    def make(q, k, v, m):
        args = [q, k, v, m, ops.constant(np.float32(0.3)), ops.constant(sink)]
        return NodeFactory("opset13").create("ScaledDotProductAttention", [a.output(0) for a in args],
                                             {"causal": False})

    check(make, inputs)


def test_sdpa_causal_ignores_mask():
    inputs = _qkv(28, L=5, S=5)
    inputs["m"] = randn(29, (5, 5), np.float32, 3.0)
    check(lambda q, k, v, m: sdpa(q, k, v, m, causal=True), inputs)


def test_sdpa_gqa_broadcast_head_dim():
    # K/V with one head broadcast over the query heads (numpy rules on the leading dims).
    inputs = _qkv(30, h=4, kv_heads=1)
    check(lambda q, k, v: sdpa(q, k, v), inputs)
    inputs["m"] = np.where(np.tril(np.ones((4, 6), bool), k=2), 0.0, -np.inf).astype(np.float32)
    check(lambda q, k, v, m: sdpa(q, k, v, m), inputs)
    check(lambda q, k, v: sdpa(q, k, v, causal=True), {k: inputs[k] for k in "qkv"})


def test_sdpa_3d_and_f16():
    check(lambda q, k, v: sdpa(q, k, v, causal=True),
          {"q": randn(31, (3, 4, 8)), "k": randn(32, (3, 4, 8)), "v": randn(33, (3, 4, 8))})
    # f16: both sides compute in f32 and round once; results straddling a rounding boundary differ by one f16 ulp
    # (2**-10 relative), which the default f16 tolerance (1e-3) would only just cover.
    check(lambda q, k, v: sdpa(q, k, v), _qkv(34, dtype=np.float16), rtol=2e-3, atol=1e-4)
    check(lambda q, k, v: sdpa(q, k, v, causal=True), _qkv(35, L=16, S=32, d=64, dtype=np.float16),
          rtol=2e-3, atol=1e-4)


# -- dynamic shapes ---------------------------------------------------------------------------
def test_dynamic_shapes():
    check(lambda a, b: ops.matmul(a, b, False, True), {"a": randn(40, (2, 3, 8)), "b": randn(41, (5, 8))},
          dynamic=True)
    check(lambda q, k, v: sdpa(q, k, v, causal=True), _qkv(42, L=3, S=5), dynamic=True)
    inputs = _qkv(43, h=4, kv_heads=1)
    inputs["m"] = randn(44, (2, 1, 4, 6))
    check(lambda q, k, v, m: sdpa(q, k, v, m), inputs, dynamic=True)
