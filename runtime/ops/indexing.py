"""Gather and scatter: Gather (v1/v7/v8), GatherND, GatherElements, ScatterUpdate,
ScatterNDUpdate, ScatterElementsUpdate, OneHot, NonZero.

Negative indices count from the end of the indexed axis. Gather-8 returns zeros for indices
out of range (its spec); the others treat them as errors.
"""

from __future__ import annotations

import numpy as np

from kvc.runtime.ops.movement import ints, norm_axis
from kvc.runtime.ops.registry import NodeSpec, register


def _take(data: np.ndarray, idx: np.ndarray, axis: int, zero_out_of_range: bool) -> np.ndarray:
    dim = data.shape[axis]
    idx = idx.astype(np.int64, copy=False)
    idx = np.where(idx < 0, idx + dim, idx)
    bad = (idx < 0) | (idx >= dim)
    if bad.any():
        if not zero_out_of_range:
            raise IndexError(f"gather index out of range [0, {dim}) on axis {axis}")
        out = np.take(data, np.where(bad, 0, idx), axis=axis)
        mask_shape = (1,) * axis + idx.shape + (1,) * (data.ndim - axis - 1)
        return np.where(bad.reshape(mask_shape), np.zeros((), data.dtype), out)
    return np.take(data, idx, axis=axis)


@register("Gather")
def gather(spec: NodeSpec):
    batch_dims = int(spec.attrs.get("batch_dims", 0))
    zero_oob = spec.version == "opset8"

    def run(data, indices, axis):
        a = norm_axis(ints(axis)[0], data.ndim)
        bd = batch_dims + indices.ndim if batch_dims < 0 else batch_dims
        if bd == 0:
            return _take(data, indices, a, zero_oob)
        batch = data.shape[:bd]
        flat_data = data.reshape((-1,) + data.shape[bd:])
        flat_idx = indices.reshape((-1,) + indices.shape[bd:])
        parts = [_take(flat_data[i], flat_idx[i], a - bd, zero_oob) for i in range(flat_data.shape[0])]
        return np.stack(parts).reshape(batch + parts[0].shape) if parts else \
            np.zeros(batch + indices.shape[bd:] + data.shape[a + 1:], data.dtype)

    return run


@register("GatherElements")
def gather_elements(spec: NodeSpec):
    axis = int(spec.attrs["axis"])

    def run(data, indices):
        a = norm_axis(axis, data.ndim)
        idx = indices.astype(np.int64)
        idx = np.where(idx < 0, idx + data.shape[a], idx)
        return np.take_along_axis(data, idx, axis=a)

    return run


@register("GatherND")
def gather_nd(spec: NodeSpec):
    batch_dims = int(spec.attrs.get("batch_dims", 0))
    keep_batch = spec.version == "opset8"

    def run(data, indices):
        idx = indices.astype(np.int64)
        bshape = data.shape[:batch_dims]
        nb = int(np.prod(bshape)) if batch_dims else 1
        d = data.reshape((nb,) + data.shape[batch_dims:])
        i = idx.reshape((nb,) + idx.shape[batch_dims:])
        k = i.shape[-1]
        out = []
        for b in range(nb):
            coords = i[b].reshape(-1, k)
            dims = np.array(d.shape[1:1 + k])
            coords = np.where(coords < 0, coords + dims, coords)
            picked = d[b][tuple(coords.T)] if k else np.broadcast_to(d[b], (coords.shape[0],) + d.shape[1:])
            out.append(picked.reshape(i.shape[1:-1] + d.shape[1 + k:]))
        res = np.stack(out)
        if batch_dims == 0:
            return res[0]
        return res.reshape(bshape + res.shape[1:]) if keep_batch else res

    return run


@register("ScatterUpdate")
def scatter_update(spec: NodeSpec):
    def run(data, indices, updates, axis):
        a = norm_axis(ints(axis)[0], data.ndim)
        out = data.copy()
        idx = indices.astype(np.int64).reshape(-1)
        idx = np.where(idx < 0, idx + data.shape[a], idx)
        upd = updates.reshape(data.shape[:a] + (idx.size,) + data.shape[a + 1:])
        moved = np.moveaxis(out, a, 0)
        moved[idx] = np.moveaxis(upd, a, 0)
        return out

    return run


_REDUCE = {
    "sum": np.add, "sub": np.subtract, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
}


@register("ScatterNDUpdate")
def scatter_nd_update(spec: NodeSpec):
    reduction = str(spec.attrs.get("reduction", "none")).lower()

    def run(data, indices, updates):
        out = data.copy()
        idx = indices.astype(np.int64)
        k = idx.shape[-1]
        coords = idx.reshape(-1, k)
        dims = np.array(data.shape[:k])
        coords = np.where(coords < 0, coords + dims, coords)
        upd = updates.reshape((coords.shape[0],) + data.shape[k:])
        for c, u in zip(coords, upd):
            key = tuple(c)
            out[key] = u if reduction == "none" else _REDUCE[reduction](out[key], u)
        return out

    return run


@register("ScatterElementsUpdate")
def scatter_elements_update(spec: NodeSpec):
    reduction = str(spec.attrs.get("reduction", "none")).lower()
    use_init = bool(spec.attrs.get("use_init_val", True))

    def run(data, indices, updates, axis):
        a = norm_axis(ints(axis)[0], data.ndim)
        idx = indices.astype(np.int64)
        idx = np.where(idx < 0, idx + data.shape[a], idx)
        out = data.copy()
        if reduction == "none":
            np.put_along_axis(out, idx, updates, axis=a)
            return out
        # Positions of every update in the output, in row-major update order.
        grid = list(np.indices(idx.shape))
        grid[a] = idx
        targets = tuple(g.reshape(-1) for g in grid)
        vals = updates.reshape(-1)
        touched = np.zeros(out.shape, bool)
        touched[targets] = True
        acc = out.astype(np.float64) if reduction == "mean" else out
        if not use_init:
            identity = {"sum": 0, "mean": 0, "prod": 1,
                        "min": np.inf if np.issubdtype(out.dtype, np.floating) else np.iinfo(out.dtype).max,
                        "max": -np.inf if np.issubdtype(out.dtype, np.floating) else np.iinfo(out.dtype).min}
            acc[touched] = identity[reduction]
        ufunc = {"sum": np.add, "mean": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[reduction]
        ufunc.at(acc, targets, vals)
        if reduction == "mean":
            counts = np.zeros(out.shape, np.int64)
            np.add.at(counts, targets, 1)
            counts = counts + (1 if use_init else 0)
            mean = acc / np.where(counts == 0, 1, counts)
            if np.issubdtype(out.dtype, np.integer):
                mean = np.floor(mean)  # OpenVINO rounds the integer mean down
            acc = np.where(touched, mean, out)
        return np.asarray(acc).astype(out.dtype)

    return run


@register("OneHot")
def one_hot(spec: NodeSpec):
    axis = int(spec.attrs.get("axis", -1))
    # OneHot-1: an index outside [0, depth), negative ones included, gives an all-off row; a later
    # version's negative_indices_mode="normalize" counts negative indices from the end.
    normalize = str(spec.attrs.get("negative_indices_mode", "ignore_negative")).lower() == "normalize"
    out = spec.out_dtype

    def run(indices, depth, on_value, off_value):
        d = ints(depth)[0]
        idx = indices.astype(np.int64)
        if normalize:
            idx = np.where(idx < 0, idx + d, idx)
        a = norm_axis(axis, idx.ndim + 1)
        hot = np.expand_dims(idx, a) == np.arange(d).reshape((1,) * a + (d,) + (1,) * (idx.ndim - a))
        return np.where(hot, on_value.reshape(()), off_value.reshape(())).astype(out)

    return run


@register("NonZero")
def non_zero(spec: NodeSpec):
    """The index tuples of the nonzero elements, [rank, count], in row-major order (its spec;
    NaN is nonzero)."""
    out = spec.out_dtype

    def run(data):
        return np.stack(np.nonzero(data)).astype(out) if data.ndim else np.zeros((0, int(data != 0)), out)

    return run
