"""Shape and data movement: Reshape, Squeeze, Unsqueeze, Transpose, Concat, Split, VariadicSplit,
Slice, StridedSlice, Tile, Broadcast, Pad, ShapeOf, Range, Convert, ConvertLike.

Shape inputs arrive as integer arrays; negative axes count from the end. Results may be views
of their inputs: kernels never write into an input.
"""

from __future__ import annotations

import numpy as np

from kvc.runtime.ops.registry import NodeSpec, register


def ints(a) -> list[int]:
    return [int(v) for v in np.asarray(a).reshape(-1)]


def norm_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"axis {axis} out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


@register("Reshape")
def reshape(spec: NodeSpec):
    special_zero = bool(spec.attrs.get("special_zero", False))

    def run(x, shape):
        dims = ints(shape)
        if special_zero:
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        return x.reshape(dims)

    return run


@register("Squeeze")
def squeeze(spec: NodeSpec):
    allow_skip = bool(spec.attrs.get("allow_axis_skip", False))

    def run(x, axes=None):
        if axes is None:
            return x.reshape([d for d in x.shape if d != 1])
        ax = sorted({norm_axis(a, x.ndim) for a in ints(axes)})
        ax = [a for a in ax if x.shape[a] == 1 or not allow_skip]
        for a in ax:
            if x.shape[a] != 1:
                raise ValueError(f"cannot squeeze axis {a} of size {x.shape[a]}")
        return np.squeeze(x, axis=tuple(ax)) if ax else x

    return run


@register("Unsqueeze")
def unsqueeze(spec: NodeSpec):
    def run(x, axes):
        rank = x.ndim + len(ints(axes))
        ax = sorted({norm_axis(a, rank) for a in ints(axes)})
        return np.expand_dims(x, tuple(ax))

    return run


@register("Transpose")
def transpose(spec: NodeSpec):
    def run(x, order):
        perm = ints(order)
        return np.transpose(x, [norm_axis(p, x.ndim) for p in perm] if perm else None)

    return run


@register("Concat")
def concat(spec: NodeSpec):
    axis = int(spec.attrs["axis"])
    out = spec.out_dtype
    return lambda *xs: np.concatenate(xs, axis=norm_axis(axis, xs[0].ndim)).astype(out, copy=False)


@register("Split")
def split(spec: NodeSpec):
    n = int(spec.attrs["num_splits"])

    def run(x, axis):
        return tuple(np.split(x, n, axis=norm_axis(ints(axis)[0], x.ndim)))

    return run


@register("VariadicSplit")
def variadic_split(spec: NodeSpec):
    def run(x, axis, lengths):
        a = norm_axis(ints(axis)[0], x.ndim)
        sizes = ints(lengths)
        if -1 in sizes:
            sizes[sizes.index(-1)] = x.shape[a] - (sum(sizes) + 1)
        bounds = np.cumsum(sizes)[:-1]
        return tuple(np.split(x, bounds, axis=a))

    return run


@register("Slice")
def slice_(spec: NodeSpec):
    def run(x, start, stop, step, axes=None):
        starts, stops, steps = ints(start), ints(stop), ints(step)
        ax = ints(axes) if axes is not None else list(range(len(starts)))
        index = [slice(None)] * x.ndim
        for a, s, e, st in zip(ax, starts, stops, steps):
            if st == 0:
                raise ValueError("Slice step must not be 0")
            index[norm_axis(a, x.ndim)] = slice(*_clamp_slice(s, e, st, x.shape[norm_axis(a, x.ndim)]))
        return x[tuple(index)]

    return run


def _clamp_slice(start: int, stop: int, step: int, dim: int) -> tuple[int | None, int | None, int]:
    """Python slicing already clamps; only huge sentinels (INT64_MAX/MIN) need taming."""
    big = 1 << 62
    start = max(min(start, big), -big)
    stop = max(min(stop, big), -big)
    if step < 0 and stop < -dim:
        stop = None  # run through index 0
    return start, stop, step


@register("StridedSlice")
def strided_slice(spec: NodeSpec):
    a = spec.attrs

    def mask(name):
        return [int(v) for v in a.get(name, [])]

    begin_mask, end_mask = mask("begin_mask"), mask("end_mask")
    new_axis, shrink, ellipsis = mask("new_axis_mask"), mask("shrink_axis_mask"), mask("ellipsis_mask")

    def bit(m, i):
        return i < len(m) and m[i] == 1

    def run(x, begin, end, stride=None):
        b, e = ints(begin), ints(end)
        s = ints(stride) if stride is not None else [1] * len(b)
        index: list = []
        dim = 0  # input dimension the next spec entry refers to
        n_spec = len(b)
        consumed_by_spec = sum(1 for i in range(n_spec) if not bit(new_axis, i) and not bit(ellipsis, i))
        for i in range(n_spec):
            if bit(ellipsis, i):
                span = x.ndim - consumed_by_spec
                index.extend([slice(None)] * span)
                dim += span
            elif bit(new_axis, i):
                index.append(None)
            elif bit(shrink, i):
                idx = b[i] + x.shape[dim] if b[i] < 0 else b[i]
                index.append(idx)
                dim += 1
            else:
                start = None if bit(begin_mask, i) else b[i]
                stop = None if bit(end_mask, i) else e[i]
                st = s[i]
                if stop is not None and st < 0 and stop < -x.shape[dim]:
                    stop = None
                index.append(slice(start, stop, st))
                dim += 1
        return x[tuple(index)]

    return run


@register("Tile")
def tile(spec: NodeSpec):
    return lambda x, repeats: np.tile(x, ints(repeats))


@register("Broadcast")
def broadcast(spec: NodeSpec):
    mode = str(spec.attrs.get("mode", "numpy")).lower()

    def run(x, target, axes_mapping=None):
        shape = ints(target)
        if mode == "bidirectional":
            return np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(shape)))
        if mode == "explicit":
            mapping = ints(axes_mapping)
            expanded = [1] * len(shape)
            for src, dst in enumerate(mapping):
                expanded[dst] = x.shape[src]
            return np.broadcast_to(x.reshape(expanded), shape)
        if mode in ("numpy", "pdpd"):
            return np.broadcast_to(x, shape)
        raise NotImplementedError(f"Broadcast mode {mode}")

    return run


@register("Pad")
def pad(spec: NodeSpec):
    mode = str(spec.attrs.get("pad_mode", "constant")).lower()
    np_mode = {"constant": "constant", "edge": "edge", "reflect": "reflect", "symmetric": "symmetric"}[mode]

    def run(x, begins, ends, value=None):
        pb, pe = ints(begins), ints(ends)
        # Negative pads crop (Pad-12); do it first, then pad the non-negative part.
        crop = tuple(slice(max(-b, 0), x.shape[i] - max(-e, 0)) for i, (b, e) in enumerate(zip(pb, pe)))
        x = x[crop]
        widths = [(max(b, 0), max(e, 0)) for b, e in zip(pb, pe)]
        if np_mode == "constant":
            fill = np.asarray(value).reshape(-1)[0] if value is not None else 0
            return np.pad(x, widths, mode="constant", constant_values=fill)
        return np.pad(x, widths, mode=np_mode)

    return run


@register("ShapeOf")
def shape_of(spec: NodeSpec):
    out = spec.out_dtype
    return lambda x: np.array(x.shape, dtype=out)


@register("Range")
def range_(spec: NodeSpec):
    out = spec.out_dtype

    def run(start, stop, step):
        a, b, s = (np.asarray(v).reshape(-1)[0] for v in (start, stop, step))
        if np.issubdtype(out, np.integer):
            a, b, s = int(a), int(b), int(s)
        n = max(0, int(np.ceil((float(b) - float(a)) / float(s)))) if s != 0 else 0
        return (np.asarray(a, dtype=np.float64 if not np.issubdtype(out, np.integer) else np.int64)
                + np.arange(n) * s).astype(out)

    return run


def convert_array(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """OpenVINO's Convert: float→int truncates toward zero then wraps; anything→bool is != 0."""
    if x.dtype == dtype:
        return x
    if dtype == np.bool_:
        return x != 0
    if np.issubdtype(dtype, np.integer) and np.issubdtype(x.dtype, np.floating):
        t = np.trunc(x)
        t = np.where(np.isfinite(t), t, 0)
        if dtype == np.uint64:
            return np.where(t < 0, t.astype(np.int64).astype(np.uint64), t.astype(np.uint64))
        return t.astype(np.int64).astype(dtype)
    return x.astype(dtype)


@register("Convert")
def convert(spec: NodeSpec):
    out = spec.out_dtype
    return lambda x: convert_array(x, out)


@register("ConvertLike")
def convert_like(spec: NodeSpec):
    out = spec.out_dtype
    return lambda x, like: convert_array(x, out)
