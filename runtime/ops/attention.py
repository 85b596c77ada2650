"""ScaledDotProductAttention (opset13), exactly as its specification's reference code:

    attn = softmax(Q @ K^T * scale + bias) @ V
    with a sink (input 5, broadcast to [..., L, 1]): softmax over [scores, sink], sink column dropped
    bias = triu(-inf, k=1) over [L, S] if causal (the mask input is then ignored),
           else where(mask, 0, -inf) for a boolean mask, else the additive mask.

Leading dimensions broadcast (numpy rules), which is how GQA arrives after optimum's
Unsqueeze/Broadcast/Reshape head expansion.
"""

from __future__ import annotations

import numpy as np

from kvc.runtime.ops import products
from kvc.runtime.ops.elementwise import wide
from kvc.runtime.ops.reductions import softmax_array
from kvc.runtime.ops.registry import NodeSpec, register


@register("ScaledDotProductAttention")
def sdpa(spec: NodeSpec):
    causal = bool(spec.attrs.get("causal", False))
    out = spec.out_dtype

    def run(q, k, v, mask=None, scale=None, sink=None):
        q, k, v = wide(q), wide(k), wide(v)  # f16 attention computes in f32, rounded once at the output
        # One layout, so one result: BLAS sums a product in another order when K or V arrive as a
        # transposed view (a lowered KVCache's), 2e-7 apart on falcon_alibi's 32 heads of 2
        # (tests/passes/test_fuse_kvcache.py: fuse then lower is bit-identical). A no-op for the
        # contiguous K and V of a Concat, the static and source models'.
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        dt = q.dtype
        s = (np.asarray(scale, dtype=dt).reshape(()) if scale is not None
             else dt.type(1.0 / np.sqrt(q.shape[-1])))
        w = products.matmul(q, np.swapaxes(k, -1, -2)) * s
        L, S = q.shape[-2], k.shape[-2]
        if causal:
            w = w + np.triu(np.full((L, S), -np.inf, dtype=dt), k=1)
        elif mask is not None:
            if mask.dtype == np.bool_:
                w = w + np.where(mask, dt.type(0), dt.type(-np.inf))
            else:
                w = w + mask.astype(dt, copy=False)
        if sink is None:
            return products.matmul(softmax_array(w, -1), v).astype(out, copy=False)
        column = np.broadcast_to(wide(sink).astype(dt, copy=False), w.shape[:-1] + (1,))
        p = softmax_array(np.concatenate([w, column], axis=-1), -1)[..., :-1]
        return products.matmul(p, v).astype(out, copy=False)

    return run
