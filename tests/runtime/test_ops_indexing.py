"""Gather and scatter: kvc's interpreter against OpenVINO CPU (f32) on random inputs.

Gather (v1/v7/v8), GatherND (v5/v8), GatherElements, ScatterUpdate, ScatterNDUpdate (v3/v15),
ScatterElementsUpdate (v3/v12), OneHot. OpenVINO CPU dies of SIGFPE on an empty Gather and
truncates ScatterElementsUpdate's integer mean: those tests pin the spec's answer instead.
"""

from __future__ import annotations

import numpy as np
import openvino.opset1 as opset1
import openvino.opset3 as opset3
import openvino.opset4 as opset4
import openvino.opset5 as opset5
import openvino.opset7 as opset7
import openvino.opset8 as opset8
import openvino.opset12 as opset12
import openvino.opset15 as ops
import pytest

from tests.runtime.op_harness import check, check_expected, ov_reference, randint, randn, rng


def i64(v):
    return np.array(v, np.int64)


# -- Gather -----------------------------------------------------------------------------------
GATHERS = [  # data shape, indices shape, axis, batch_dims
    ((5, 4, 3), (2,), 0, 0), ((5, 4, 3), (2, 3), 1, 0), ((5, 4, 3), (), -1, 0), ((5, 4, 3), (6,), -2, 0),
    ((2, 5, 3), (2, 4), 1, 1), ((2, 3, 5, 4), (2, 3, 2), 2, 2), ((2, 3, 5, 4), (2, 6), -1, 1),
    ((2, 3, 4), (2, 3, 2), 2, -1),
]
GATHER_VERSIONS = {
    "v1": lambda d, i, a, b: opset1.gather(d, i, i64(a)),
    "v7": lambda d, i, a, b: opset7.gather(d, i, i64(a), b),
    "v8": lambda d, i, a, b: opset8.gather(d, i, i64(a), b),
}


@pytest.mark.parametrize("case,version", [(c, v) for c in GATHERS for v in GATHER_VERSIONS if v != "v1" or c[3] == 0],
                         ids=lambda c: c if isinstance(c, str) else str(GATHERS.index(c)))  # Gather-1: no batch_dims
def test_gather(case, version):
    dshape, ishape, axis, bd = case
    data = randn(1, dshape)
    dim = dshape[axis]
    idx = randint(2, ishape, 0, max(dim, 1), np.int32)
    check(lambda d, i: GATHER_VERSIONS[version](d, i, axis, bd), {"d": data, "i": idx})


@pytest.mark.parametrize("version", GATHER_VERSIONS)
@pytest.mark.parametrize("dshape,ishape", [((5, 0, 3), (2,)), ((5, 4), (0, 2))], ids=str)
def test_gather_empty(dshape, ishape, version):
    data, idx = randn(1, dshape), np.ones(ishape, np.int32)
    make = lambda d, i: GATHER_VERSIONS[version](d, i, 0, 0)  # noqa: E731
    expected = np.take(data, idx, axis=0)
    # OpenVINO CPU dies of SIGFPE (division by zero) on an empty Gather; the core reference gives these shapes.
    assert ov_reference(make, {"d": data, "i": idx})[0].shape == expected.shape
    check_expected(make, {"d": data, "i": idx}, expected)


def test_gather_v8_negative_indices():
    # Gather-8 counts negative indices from the end (Gather-1/7 define only [0, dim): not tested).
    data = randn(3, (4, 6, 2))
    idx = np.array([[-1, 0, -6], [5, -2, 3]], np.int64)
    check(lambda d, i: GATHER_VERSIONS["v8"](d, i, 1, 0), {"d": data, "i": idx})
    check(lambda d, i: GATHER_VERSIONS["v8"](d, i, 1, 1), {"d": data, "i": idx[[0, 1, 0, 1]]})


def test_gather_v8_out_of_range_gives_zeros():
    data = randn(4, (3, 5))
    idx = np.array([0, 5, -6, 7, -1, 100], np.int32)
    check(lambda d, i: opset8.gather(d, i, i64(1)), {"d": data, "i": idx})
    check(lambda d, i: opset8.gather(d, i, i64(1), 1), {"d": data, "i": np.array([[1, 9], [-7, 4], [2, 5]], np.int32)})


@pytest.mark.parametrize("dtype", [np.int64, np.float16, np.bool_, np.uint8])
def test_gather_dtypes(dtype):
    data = (rng(5).random((4, 3)) < 0.5) if dtype == np.bool_ else randint(5, (4, 3), 0, 100, np.int32).astype(dtype)
    check(lambda d, i: opset8.gather(d, i, i64(0)), {"d": data, "i": np.array([3, -1, 0], np.int64)})




# -- GatherND, GatherElements -----------------------------------------------------------------
GATHER_NDS = [  # data shape, indices shape (last dim = index depth), batch_dims
    ((4, 5), (3, 2), 0), ((4, 5), (3, 1), 0), ((4, 5, 6), (2, 3, 2), 0), ((4, 5, 6), (1,), 0),
    ((2, 5, 6), (2, 3, 1), 1), ((2, 3, 5, 6), (2, 3, 4, 1), 2), ((2, 3, 5, 6), (2, 3, 2), 2),
    ((2, 3, 5), (2, 4, 2), 1), ((2, 3, 4), (2, 1), 1),
]


@pytest.mark.parametrize("version", ["v5", "v8"])
@pytest.mark.parametrize("case", GATHER_NDS, ids=[str(i) for i in range(len(GATHER_NDS))])
def test_gather_nd(case, version):
    dshape, ishape, bd = case
    fn = opset5.gather_nd if version == "v5" else opset8.gather_nd
    data = randn(7, dshape)
    k = ishape[-1]
    limits = np.array(dshape[bd:bd + k])
    idx = (rng(8).integers(0, 1 << 30, ishape) % limits).astype(np.int32)
    check(lambda d, i: fn(d, i, bd), {"d": data, "i": idx})


def test_gather_nd_negative_indices():
    data = randn(9, (4, 5, 3))
    idx = np.array([[-1, 0], [2, -5], [-4, -1]], np.int64)
    check(lambda d, i: opset8.gather_nd(d, i), {"d": data, "i": idx})


@pytest.mark.parametrize("axis", [0, 1, -1, -3])
def test_gather_elements(axis):
    data = randn(10, (3, 4, 5))
    ishape = [3, 4, 5]
    ishape[axis] = 6
    dim = data.shape[axis]
    idx = randint(11, ishape, -dim, dim, np.int32)  # negative indices count from the end
    check(lambda d, i: ops.gather_elements(d, i, axis), {"d": data, "i": idx})
    check(lambda d, i: ops.gather_elements(d, i, axis), {"d": data, "i": idx.astype(np.int64)})


# -- ScatterUpdate ----------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_update(axis):
    data = randn(12, (4, 5, 3))
    dim = data.shape[axis]
    idx = rng(13).permutation(dim)[:2].reshape(2).astype(np.int32)
    a = axis % 3
    ushape = data.shape[:a] + idx.shape + data.shape[a + 1:]
    check(lambda d, i, u: opset3.scatter_update(d, i, u, i64(axis)),
          {"d": data, "i": idx, "u": randn(14, ushape)})
    # 2-D indices (negative ones are out of bounds for ScatterUpdate-3: CPU and core reference refuse them)
    idx2 = rng(15).permutation(dim)[:2].reshape(1, 2).astype(np.int64)
    ushape2 = data.shape[:a] + idx2.shape + data.shape[a + 1:]
    check(lambda d, i, u: opset3.scatter_update(d, i, u, i64(axis)),
          {"d": data, "i": idx2, "u": randn(16, ushape2)})


# -- ScatterNDUpdate --------------------------------------------------------------------------
def _nd_case(seed, dshape, n, k, unique):
    r = rng(seed)
    n = min(n, int(np.prod(dshape[:k]))) if unique else n
    if unique:
        flat = r.permutation(int(np.prod(dshape[:k])))[:n]
        idx = np.stack(np.unravel_index(flat, dshape[:k]), axis=-1)
    else:
        idx = r.integers(0, np.array(dshape[:k]), (n, k))
    return idx.astype(np.int32), (n,) + tuple(dshape[k:])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_scatter_nd_update_v3(k):
    data = randn(17, (4, 3, 5))
    idx, ushape = _nd_case(18, data.shape, 3, k, unique=True)
    check(lambda d, i, u: opset4.scatter_nd_update(d, i, u), {"d": data, "i": idx, "u": randn(19, ushape)})
    idx_neg = idx - np.array(data.shape[:k], np.int32)  # the same positions, counted from the end
    check(lambda d, i, u: opset4.scatter_nd_update(d, i, u), {"d": data, "i": idx_neg, "u": randn(19, ushape)})


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("reduction", ["none", "sum", "sub", "prod", "min", "max"])
@pytest.mark.parametrize("k", [1, 2])
def test_scatter_nd_update_v15(k, reduction, dtype):
    data = randn(20, (4, 3, 5), np.float32, 3.0)
    data = data.astype(dtype) if dtype == np.float32 else np.round(data).astype(dtype)
    idx, ushape = _nd_case(21, data.shape, 5, k, unique=reduction == "none")  # duplicates accumulate
    upd = randn(22, ushape, np.float32, 2.0)
    upd = upd.astype(dtype) if dtype == np.float32 else np.round(upd).astype(dtype)
    check(lambda d, i, u: ops.scatter_nd_update(d, i, u, reduction), {"d": data, "i": idx, "u": upd})


def test_scatter_nd_update_bool_and_2d_indices():
    data = rng(23).random((3, 4)) < 0.5
    idx = np.array([[[0, 1], [2, 3]], [[1, 0], [0, 0]]], np.int64)
    upd = np.array([[True, False], [True, True]])
    check(lambda d, i, u: ops.scatter_nd_update(d, i, u, "max"), {"d": data, "i": idx, "u": upd})
    check(lambda d, i, u: ops.scatter_nd_update(d, i, u), {"d": data, "i": idx, "u": upd})


# -- ScatterElementsUpdate --------------------------------------------------------------------
def _unique_along(seed, shape, axis, n):
    """2-D indices with n distinct targets along `axis` in every line (no duplicates)."""
    a = axis % 2
    lines = shape[1 - a]
    idx = np.stack([rng(seed + j).permutation(shape[a])[:n] for j in range(lines)], axis=0)  # [lines, n]
    return (idx.T if a == 0 else idx).astype(np.int32)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_elements_update_v3(axis):
    data = randn(24, (4, 5))
    idx = _unique_along(25, data.shape, axis, 3)  # duplicates have no defined order in v3
    dim = data.shape[axis]
    upd = randn(26, idx.shape)
    check(lambda d, i, u: opset3.scatter_elements_update(d, i, u, i64(axis)), {"d": data, "i": idx, "u": upd})
    check(lambda d, i, u: opset3.scatter_elements_update(d, i, u, i64(axis)), {"d": data, "i": idx - dim, "u": upd})


@pytest.mark.parametrize("dtype,reduction", [(d, r) for d in (np.float32, np.int32)  # integer mean: see below
                                             for r in ("none", "sum", "prod", "min", "max", "mean")
                                             if not (d == np.int32 and r == "mean")],
                         ids=lambda v: v if isinstance(v, str) else np.dtype(v).name)
@pytest.mark.parametrize("use_init", [True, False], ids=["init", "noinit"])
@pytest.mark.parametrize("axis", [0, -1])
def test_scatter_elements_update_v12(axis, reduction, use_init, dtype):
    data = randn(27, (4, 6), np.float32, 3.0)
    data = data.astype(dtype) if dtype == np.float32 else np.round(data).astype(dtype)
    dim = data.shape[axis]
    ishape = (3, 6) if axis == 0 else (4, 3)
    if reduction == "none":
        idx = _unique_along(28, data.shape, axis, 3)
    else:
        idx = randint(28, ishape, -dim, dim, np.int32)  # duplicates and negative indices
    upd = randn(29, ishape, np.float32, 3.0)
    upd = upd.astype(dtype) if dtype == np.float32 else np.round(upd).astype(dtype)
    check(lambda d, i, u: opset12.scatter_elements_update(d, i, u, i64(axis), reduction, use_init),
          {"d": data, "i": idx.astype(np.int64), "u": upd})


@pytest.mark.parametrize("use_init", [True, False], ids=["init", "noinit"])
def test_scatter_elements_update_mean_int_floors(use_init):
    data = np.array([[0, 0, 0, 0, 7]], np.int32)
    idx = np.array([[0, 0, 1, 1, 2, 2, 3, 3]], np.int64)
    upd = np.array([[-3, 0, 3, 0, -5, 0, 5, 0]], np.int32)
    # with the initial 0: -3/3, 3/3, -5/3, 5/3; without: -3/2, 3/2, -5/2, 5/2; position 4 is untouched
    expected = np.array([[-1, 1, -2, 1, 7]] if use_init else [[-2, 1, -3, 2, 7]], np.int32)
    make = lambda d, i, u: opset12.scatter_elements_update(d, i, u, i64(1), "mean", use_init)  # noqa: E731
    inputs = {"d": data, "i": idx, "u": upd}
    # OpenVINO CPU truncates an integer mean toward zero (-5/3 -> -1); the spec and core reference round down (-2).
    assert np.array_equal(ov_reference(make, inputs)[0], expected)
    check_expected(make, inputs, expected)


# -- OneHot -----------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot(axis):
    idx = np.array([[0, 3, -1], [5, 2, 1]], np.int64)  # -1 and 5 are outside [0, 5): all off
    check(lambda i: opset1.one_hot(i, i64(5), np.array(2.5, np.float32), np.array(-1.0, np.float32), axis), {"i": idx})


# -- NonZero ----------------------------------------------------------------------------------
@pytest.mark.parametrize("out", ["i64", "i32"])
@pytest.mark.parametrize("data", [np.array([[0, 2, 0], [1, 0, -3]], np.int64),
                                  np.array([[[0.0, np.nan], [-0.0, 1.5]]], np.float32),  # NaN is nonzero, -0 is not
                                  np.zeros((2, 3), np.float32), np.array([1, 0, 1], np.int64)])
def test_non_zero(data, out):
    check(lambda d: opset3.non_zero(d, out), {"d": data}, dynamic=True)


# -- dynamic shapes ---------------------------------------------------------------------------
def test_dynamic_shapes():
    data = randn(40, (2, 5, 3))
    check(lambda d, i: opset8.gather(d, i, i64(1), 1), {"d": data, "i": np.array([[4, -1], [0, 7]], np.int64)},
          dynamic=True)
    check(lambda d, i: opset8.gather_nd(d, i, 1), {"d": data, "i": np.array([[[1], [4]], [[0], [2]]], np.int32)},
          dynamic=("d",))  # dynamic indices leave the output rank unknown, which the CPU plugin refuses
    check(lambda d, i, u: ops.scatter_nd_update(d, i, u, "sum"),
          {"d": data, "i": np.array([[1, 2], [1, 2], [0, 4]], np.int32), "u": randn(41, (3, 3))}, dynamic=True)
