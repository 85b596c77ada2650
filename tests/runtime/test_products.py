"""Inside `products.pooled()` (the compile's check) kvc's numpy runtime computes a product the
same however many threads are free to compute it (kvc.runtime.ops.products): OpenBLAS's results
follow its thread count, and a compile whose check had one BLAS thread or two as a device
compile beside it ran wrote other numbers into its manifest from run to run."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from kvc.runtime.ops import products
from kvc.runtime.session import NumpySession


def _blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def _linear(rows: int, k: int, n: int) -> tuple[ov.Model, np.ndarray, np.ndarray]:
    """y = x @ w^T (transpose_b, as optimum's linear layers), its input and its weight."""
    rng = np.random.default_rng(0)
    x = ops.parameter([rows, k], np.float32, name="x")
    x.output(0).set_names({"x"})
    w = rng.standard_normal((n, k), dtype=np.float32)
    y = ops.matmul(x, ops.constant(w, name="w"), False, True)
    y.output(0).set_names({"y"})
    return ov.Model([y], [x], "linear"), rng.standard_normal((rows, k), dtype=np.float32), w


def test_a_product_is_cut_by_its_shapes_alone(monkeypatch):
    assert products.column_blocks(1, 64, 128) == 1  # small: whole, in the calling thread
    assert products.column_blocks(521, 1024, 1024) == 4
    assert products.column_blocks(1, 1024, 32000) == products.MAX_BLOCKS
    assert products.column_blocks(521, 1024, 200) == 1  # too narrow to cut
    monkeypatch.setattr(products, "_pool", lambda: pytest.fail("the pool outside pooled()"))
    a, b = np.ones((64, 1024), np.float32), np.ones((1024, 1024), np.float32)
    assert (products.matmul(a, b) == 1024).all()  # numpy's own, on BLAS's threads


@pytest.mark.parametrize("shape", [(33, 64, 256), (521, 1024, 1024), (300, 512, 2816)])
def test_pooled_products_are_the_same_bytes_whatever_blas_may_use_and_whoever_runs_them(shape):
    """The same inputs, run with BLAS allowed one thread or two, the blocks on the pool or in
    turn: byte-identical outputs (numpy's own product differed by 6e-6 between one BLAS thread
    and two at [33, 64] @ [64, 256] on an AMD EPYC), and BLAS's threads given back."""
    model, x, w = _linear(*shape)
    session = NumpySession(model)
    runs = []
    for threads in (2, 1):
        with threadpool_limits(limits=threads, user_api="blas"):
            with products.pooled():
                runs.append(session.infer({"x": x})["y"])
            assert _blas_threads() == {threads}  # given back
    with pytest.MonkeyPatch.context() as patch, products.pooled():  # the blocks in turn, in this thread
        patch.setattr(products, "_run", lambda tasks: [t() for t in tasks])
        runs.append(session.infer({"x": x})["y"])
    assert all(r.tobytes() == runs[0].tobytes() for r in runs)
    np.testing.assert_allclose(runs[0], x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-3)


def test_stacked_products_split_between_matrices_and_broadcast():
    """Attention's products: [heads] stacks, one side broadcast (GQA), cut between matrices,
    each the GEMM numpy runs for it."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 16, 128, 64), dtype=np.float32)
    k = rng.standard_normal((1, 1, 64, 512), dtype=np.float32)  # broadcast over the heads
    with products.pooled():
        got = products.matmul(q, k)
        want = np.matmul(q, k)
    assert got.shape == (1, 16, 128, 512) and got.tobytes() == want.tobytes()
