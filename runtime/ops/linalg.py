"""MatMul and Einsum.

MatMul against a constant weight is the hot path of LLM decoding: a 3-D activation times a
2-D weight is folded to one 2-D BLAS call (numpy would otherwise loop over the batch), and
`transpose_b` is taken as a strided view, never a copy. Products run through
`kvc.runtime.ops.products`: numpy's, or in the compile's check blocks that give the same
bytes on any number of cores.
"""

from __future__ import annotations

import numpy as np

from kvc.runtime.ops import products
from kvc.runtime.ops.elementwise import wide
from kvc.runtime.ops.registry import NodeSpec, register


@register("MatMul")
def matmul(spec: NodeSpec):
    ta, tb = bool(spec.attrs.get("transpose_a", False)), bool(spec.attrs.get("transpose_b", False))
    out = spec.out_dtype

    def run(a, b):
        a1, b1 = a.ndim == 1, b.ndim == 1
        if a1:
            a = a[None, :]
        elif ta:
            a = np.swapaxes(a, -1, -2)
        if b1:
            b = b[:, None]
        elif tb:
            b = np.swapaxes(b, -1, -2)
        if a.ndim > 2 and b.ndim == 2:  # [.., M, K] @ [K, N] as one GEMM
            r = products.matmul(a.reshape(-1, a.shape[-1]), b).reshape(a.shape[:-1] + (b.shape[-1],))
        else:
            r = products.matmul(a, b)
        if a1:
            r = r[..., 0, :]
        if b1:
            r = r[..., 0]
        return r.astype(out, copy=False)

    return run


@register("Einsum")
def einsum(spec: NodeSpec):
    equation = str(spec.attrs["equation"]).replace(" ", "")
    out = spec.out_dtype
    return lambda *xs: np.asarray(np.einsum(equation, *(wide(x) for x in xs)), dtype=out)  # f16 sums in f32
