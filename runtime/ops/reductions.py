"""Reductions and normalizations: Reduce*, Softmax, LogSoftmax, MVN, NormalizeL2, CumSum, TopK."""

from __future__ import annotations

import numpy as np

from kvc.runtime.ops.elementwise import wide
from kvc.runtime.ops.registry import NodeSpec, register


def _axes(axes, rank: int) -> tuple[int, ...]:
    return tuple(sorted({int(a) + rank if int(a) < 0 else int(a) for a in np.asarray(axes).reshape(-1)}))


def _reduce(op_type: str, fn):
    @register(op_type)
    def factory(spec: NodeSpec):
        keep = bool(spec.attrs.get("keep_dims", False))
        out = spec.out_dtype

        def run(x, axes):
            # An empty axes list reduces over nothing: each element alone (ReduceL1/L2 still take |x|).
            r = fn(wide(x), _axes(axes, x.ndim), keep)
            if np.issubdtype(out, np.integer) and not np.issubdtype(np.asarray(r).dtype, np.integer):
                r = np.trunc(r)
            return np.asarray(r).astype(out, copy=False)

        return run

    return factory


_reduce("ReduceSum", lambda x, a, k: np.sum(x, axis=a, keepdims=k, dtype=x.dtype))
_reduce("ReduceProd", lambda x, a, k: np.prod(x, axis=a, keepdims=k, dtype=x.dtype))
def _extreme(fn, largest: bool):
    """Max/min; over an empty set the result is the reduction's identity (-inf/+inf, or the
    integer type's lowest/highest value), as ONNX defines it and OpenVINO's CPU plugin computes."""
    def run(x, a, k):
        if x.size:
            return fn(x, axis=a, keepdims=k)
        if x.dtype == np.bool_:
            init = not largest
        elif np.issubdtype(x.dtype, np.integer):
            init = np.iinfo(x.dtype).min if largest else np.iinfo(x.dtype).max
        else:
            init = -np.inf if largest else np.inf
        return fn(x, axis=a, keepdims=k, initial=init)
    return run


_reduce("ReduceMax", _extreme(np.max, largest=True))
_reduce("ReduceMin", _extreme(np.min, largest=False))
_reduce("ReduceL1", lambda x, a, k: np.sum(np.abs(x), axis=a, keepdims=k, dtype=x.dtype))
_reduce("ReduceL2", lambda x, a, k: np.sqrt(np.sum(np.square(x), axis=a, keepdims=k, dtype=x.dtype)))
_reduce("ReduceLogicalAnd", lambda x, a, k: np.all(x, axis=a, keepdims=k))
_reduce("ReduceLogicalOr", lambda x, a, k: np.any(x, axis=a, keepdims=k))


def _mean(x, a, k):
    if np.issubdtype(x.dtype, np.integer):  # integer mean: integer sum, truncating division
        n = int(np.prod([x.shape[i] for i in a]))
        s = np.sum(x, axis=a, keepdims=k, dtype=x.dtype)
        return np.trunc(s / n) if n else s
    return np.mean(x, axis=a, keepdims=k, dtype=x.dtype)


_reduce("ReduceMean", _mean)


def softmax_array(x: np.ndarray, axis: int) -> np.ndarray:
    """exp(x - max) / sum, in one new array (the same arithmetic as three: a 1024-row
    prefill's attention scores are 67 MB a layer, and fresh arrays cost their page faults)."""
    e = x - np.max(x, axis=axis, keepdims=True)
    np.exp(e, out=e)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


@register("Softmax")
def softmax(spec: NodeSpec):
    axis = int(spec.attrs["axis"])
    out = spec.out_dtype
    return lambda x: softmax_array(wide(x), axis).astype(out, copy=False)


@register("LogSoftmax")
def log_softmax(spec: NodeSpec):
    axis = int(spec.attrs["axis"])
    out = spec.out_dtype

    def run(x):
        x = wide(x)
        m = np.max(x, axis=axis, keepdims=True)
        s = x - m
        return (s - np.log(np.sum(np.exp(s), axis=axis, keepdims=True))).astype(out, copy=False)

    return run


@register("MVN", "opset6")
def mvn6(spec: NodeSpec):
    normalize = bool(spec.attrs.get("normalize_variance", True))
    eps = float(spec.attrs.get("eps", 1e-9))
    inside = str(spec.attrs.get("eps_mode", "inside_sqrt")).lower() == "inside_sqrt"
    out = spec.out_dtype

    def run(x, axes):
        ax = _axes(axes, x.ndim)
        x = wide(x)
        centered = x - np.mean(x, axis=ax, keepdims=True)
        if not normalize:
            return centered.astype(out, copy=False)
        var = np.mean(np.square(centered), axis=ax, keepdims=True)
        denom = np.sqrt(var + eps) if inside else np.sqrt(var) + eps
        return (centered / denom).astype(out, copy=False)

    return run


@register("MVN", "opset2")
def mvn0(spec: NodeSpec):
    across = bool(spec.attrs.get("across_channels", False))
    normalize = bool(spec.attrs.get("normalize_variance", True))
    eps = float(spec.attrs.get("eps", 1e-9))
    out = spec.out_dtype

    def run(x):
        start = 1 if across else 2
        ax = tuple(range(start, x.ndim))
        x = wide(x)
        centered = x - np.mean(x, axis=ax, keepdims=True)
        if not normalize:
            return centered.astype(out, copy=False)
        var = np.mean(np.square(centered), axis=ax, keepdims=True)
        return (centered / np.sqrt(var + eps)).astype(out, copy=False)  # MVN-1: eps inside the root

    return run


@register("NormalizeL2")
def normalize_l2(spec: NodeSpec):
    eps = float(spec.attrs["eps"])
    add = str(spec.attrs.get("eps_mode", "add")).lower() == "add"
    out = spec.out_dtype

    def run(x, axes):
        ax = _axes(axes, x.ndim)
        if not ax:  # the spec: each element divided by itself, 1 for every non-zero element (eps unused)
            return (x != 0).astype(out)
        x = wide(x)
        sq = np.sum(np.square(x), axis=ax, keepdims=True)
        denom = np.sqrt(sq + eps) if add else np.sqrt(np.maximum(sq, eps))
        return (x / denom).astype(out, copy=False)

    return run


@register("CumSum")
def cumsum(spec: NodeSpec):
    exclusive = bool(spec.attrs.get("exclusive", False))
    reverse = bool(spec.attrs.get("reverse", False))
    out = spec.out_dtype

    def run(x, axis=None):
        a = 0 if axis is None else int(np.asarray(axis).reshape(-1)[0])
        a = a + x.ndim if a < 0 else a
        x = wide(x)  # f16 accumulates in f32
        y = np.flip(x, a) if reverse else x
        c = np.cumsum(y, axis=a, dtype=x.dtype)
        if exclusive:
            c = np.concatenate([np.zeros_like(np.take(c, [0], axis=a)), np.take(c, range(c.shape[a] - 1), axis=a)],
                               axis=a) if c.shape[a] else c
        return np.asarray(np.flip(c, a) if reverse else c, dtype=out)

    return run


@register("TopK")
def topk(spec: NodeSpec):
    axis = int(spec.attrs["axis"])
    largest = str(spec.attrs.get("mode", "max")).lower() == "max"
    sort = str(spec.attrs.get("sort", "value")).lower()
    idx_type = spec.output_types[1]

    def run(x, k):
        kk = int(np.asarray(k).reshape(-1)[0])
        a = axis + x.ndim if axis < 0 else axis
        key = -x if largest and not np.issubdtype(x.dtype, np.unsignedinteger) else x
        if largest and np.issubdtype(x.dtype, np.unsignedinteger):
            key = np.iinfo(x.dtype).max - x
        order = np.argsort(key, axis=a, kind="stable")  # ties: the lower index first
        idx = np.take(order, np.arange(min(kk, x.shape[a])), axis=a)
        if sort == "index":
            idx = np.sort(idx, axis=a)
        vals = np.take_along_axis(x, idx, axis=a)
        return vals, idx.astype(idx_type)

    return run
