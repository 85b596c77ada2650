"""Shape and data movement: Reshape, Squeeze, Unsqueeze, Transpose, Concat, Split, VariadicSplit,
Slice, StridedSlice, Tile, Broadcast, Pad, Identity, ShapeOf, Range, Convert, ConvertLike.

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
        copied = {i for i, d in enumerate(dims) if special_zero and d == 0}
        dims = [x.shape[i] if i in copied else d for i, d in enumerate(dims)]
        if -1 in dims:  # OpenVINO's rule, which also covers empty tensors (numpy refuses 0 / 0):
            # product of the input dims not copied by a special zero over the output's explicit dims,
            # and 1 when the two are equal (0 == 0 included)
            size_in = int(np.prod([d for i, d in enumerate(x.shape) if i not in copied]))
            size_out = int(np.prod([d for i, d in enumerate(dims) if i not in copied and d != -1]))
            if size_out == 0 and size_in != 0:
                raise ValueError(f"cannot infer -1 in {ints(shape)} for input shape {list(x.shape)}")
            dims[dims.index(-1)] = 1 if size_in == size_out else size_in // size_out
        return x.reshape(dims)

    return run


@register("Squeeze")
def squeeze(spec: NodeSpec):
    allow_skip = bool(spec.attrs.get("allow_axis_skip", False))

    def run(x, axes=None):
        if axes is None or not ints(axes):  # no axes, or an empty list: every dimension of size 1
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
        parts = tuple(np.split(x, n, axis=norm_axis(ints(axis)[0], x.ndim)))
        return parts if n > 1 else parts[0]  # a single-output op returns an array, not a 1-tuple

    return run


@register("VariadicSplit")
def variadic_split(spec: NodeSpec):
    def run(x, axis, lengths):
        a = norm_axis(ints(axis)[0], x.ndim)
        sizes = ints(lengths)
        if -1 in sizes:
            sizes[sizes.index(-1)] = x.shape[a] - (sum(sizes) + 1)
        bounds = np.cumsum(sizes)[:-1]
        parts = tuple(np.split(x, bounds, axis=a))
        return parts if len(parts) > 1 else parts[0]  # a single-output op returns an array, not a 1-tuple

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
    """Python slicing clamps like OpenVINO except with a negative step from below -dim: OpenVINO
    clamps that start to index 0 (one element), Python to -1 (nothing)."""
    big = 1 << 62
    start = max(min(start, big), -big)
    stop = max(min(stop, big), -big)
    if step < 0 and start < -dim:
        start = 0
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
                if start is not None and st < 0 and start < -x.shape[dim]:
                    start = 0  # as Slice: OpenVINO clamps a start below -dim to 0, Python to -1
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
    if mode == "none":  # Broadcast-1 calls its explicit mode "none" (AutoBroadcastType::NONE == EXPLICIT)
        mode = "explicit"
    pdpd_axis = int(spec.attrs.get("mode.mode.axis", -1))  # pdpd: where the data's dims start in the target

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
        if mode == "pdpd" and pdpd_axis != -1:
            start = pdpd_axis + len(shape) if pdpd_axis < 0 else pdpd_axis
            x = x.reshape((1,) * start + x.shape + (1,) * (len(shape) - start - x.ndim))
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
        if min(pb + pe, default=0) >= 0:
            widths = list(zip(pb, pe))
            if np_mode == "constant":
                fill = np.asarray(value).reshape(-1)[0] if value is not None else 0
                return np.pad(x, widths, mode="constant", constant_values=fill)
            return np.pad(x, widths, mode=np_mode)
        # Negative pads (Pad-12) crop. Output position o of an axis reads input position o - begin,
        # mapped into the input by the mode, so the padded values come from the uncropped input
        # (reflect with begin -3, end +3 on [x0..x3] gives [x3, x2, x1, x0], not a crop's reflection).
        out, inside = x, None
        for axis, (b, e) in enumerate(zip(pb, pe)):
            dim = x.shape[axis]
            j = np.arange(dim + b + e) - b
            if np_mode == "reflect":
                src = np.where(j < 0, -j, np.where(j >= dim, 2 * (dim - 1) - j, j))
            elif np_mode == "symmetric":
                src = np.where(j < 0, -j - 1, np.where(j >= dim, 2 * dim - 1 - j, j))
            else:  # edge, and constant's positions before the fill below
                src = j
            out = np.take(out, np.clip(src, 0, max(dim - 1, 0)), axis=axis)
            if np_mode == "constant":
                ok = ((j >= 0) & (j < dim)).reshape((-1,) + (1,) * (x.ndim - axis - 1))
                inside = ok if inside is None else inside & ok
        if np_mode == "constant" and inside is not None:
            fill = np.asarray(value).reshape(-1)[0] if value is not None else 0
            out = np.where(inside, out, np.asarray(fill, dtype=x.dtype))
        return out

    return run


@register("Identity")
def identity(spec: NodeSpec):
    """Identity-16: the input, unchanged (OpenVINO's ONNX frontend emits it for ONNX Identity)."""
    return lambda x: x


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
    """OpenVINO's Convert: float→int truncates toward zero then wraps; anything→bool is != 0.

    Float→int goes through a 32-bit integer (64-bit for i64/u32) as OpenVINO's x86 code does: a
    value out of that integer's range, NaN or ±inf becomes its lowest value (INT32_MIN, whose low
    8/16 bits are 0), so 300.7→u8 is 44 but 1e10→u8 is 0 and 1e10→i32 is INT32_MIN (C++ leaves
    out-of-range conversions undefined; this is what OpenVINO's CPU plugin and core compute)."""
    if x.dtype == dtype:
        return x
    if dtype == np.bool_:
        return x != 0
    if np.issubdtype(dtype, np.integer) and np.issubdtype(x.dtype, np.floating):
        t = np.trunc(x.astype(np.float64))
        if dtype == np.uint64:
            t = np.where(np.isfinite(t), t, 0)
            return np.where(t < 0, t.astype(np.int64).astype(np.uint64), t.astype(np.uint64))
        via = np.dtype(np.int64) if dtype in (np.int64, np.uint32) else np.dtype(np.int32)
        info = np.iinfo(via)
        ok = (t >= info.min) & (t < float(info.max) + 1)  # False for NaN
        return np.where(ok, t, info.min).astype(np.int64).astype(via).astype(dtype)
    return x.astype(dtype)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Values rounded to bf16 by IEEE's nearest even, kept as f32: kvc's bf16 representation,
    as OpenVINO CPU rounds bf16 arithmetic and a static model's f32 -> bf16 Convert (its JIT
    kernels' conversion: a bf16 cache written by a blob; PyTorch's rounding too). An integer's
    Convert to bf16 rounds as `openvino_bf16` (tests/runtime/test_bf16.py)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(f), f, rounded)


def openvino_bf16(x: np.ndarray) -> np.ndarray:
    """Values rounded to bf16 as OpenVINO's `bfloat16::round_to_nearest_even` rounds them
    (src/core/include/openvino/core/type/bfloat16.hpp), kept as f32: half a unit is added only
    when the kept part is odd, so an even kept part truncates (515: 512, where IEEE gives 516).
    OpenVINO's constant folding rounds so, and the CPU plugin so converts an integer to bf16
    (any shape) and an f32 of dynamic shape: Falcon's ALiBi positions
    (`slopes.bfloat16() x positions`) in the source model and in the static ones. kvc rounds an
    integer's Convert so; an f32's by IEEE (`round_to_bf16`), as the static models run it:
    a source model's runtime f32 -> bf16 Convert would be a unit apart where the two differ
    (none in the zoo)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + ((bits & np.uint32(0x10000)) >> np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(f), f, rounded)


def _converter(spec: NodeSpec):
    """x -> the node's output element type, in kvc's representation of that type."""
    out = spec.out_dtype
    dest = spec.output_etypes[0] if spec.output_etypes else str(spec.attrs.get("destination_type", ""))
    if out is None:
        raise NotImplementedError(f"{spec.type} '{spec.name}' to element type {dest}, which kvc's interpreter "
                                  "does not implement")
    if dest == "bf16":  # computed as f32, but the values must be bf16's
        if spec.input_types and np.issubdtype(spec.input_types[0], np.integer):
            return lambda x: openvino_bf16(convert_array(x, out))
        return lambda x: round_to_bf16(convert_array(x, out))
    if dest == "u4":  # held one per byte: truncate, then wrap to 4 bits like any integer Convert
        return lambda x: convert_array(x, out) & np.uint8(0x0F)
    if dest == "i4":
        return lambda x: ((convert_array(x, out) & np.int8(0x0F)) ^ np.int8(8)) - np.int8(8)
    return lambda x: convert_array(x, out)


@register("Convert")
def convert(spec: NodeSpec):
    return _converter(spec)


@register("ConvertLike")
def convert_like(spec: NodeSpec):
    conv = _converter(spec)
    return lambda x, like: conv(x)
