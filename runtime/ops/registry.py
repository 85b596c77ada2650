"""The op table of kvc's numpy interpreter.

Each op is a *kernel factory*: it receives a `NodeSpec` (type, version, attributes, input and
output element types, static output shapes) once, when a model is prepared, and returns the
kernel that runs on every call. Attribute parsing and dispatch therefore cost nothing per
inference.

    @register("Softmax", "opset1", "opset8")
    def softmax(spec: NodeSpec) -> Kernel:
        axis = spec.attrs["axis"]
        def run(x):
            ...
        return run

A kernel takes numpy arrays (one per input) and returns an array, or a tuple of arrays for a
multi-output op. Kernels never call OpenVINO to compute a value: this table *is* kvc's
definition of op semantics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import openvino as ov

Kernel = Callable[..., Any]
Factory = Callable[["NodeSpec"], Kernel]

# OpenVINO element type name -> the numpy dtype kvc computes in. Sub-byte integer types are
# unpacked to one element per byte; bf16 has no numpy type and is computed as f32.
DTYPES: dict[str, np.dtype] = {
    "f64": np.dtype(np.float64), "f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
    "bf16": np.dtype(np.float32),
    "i64": np.dtype(np.int64), "i32": np.dtype(np.int32), "i16": np.dtype(np.int16), "i8": np.dtype(np.int8),
    "u64": np.dtype(np.uint64), "u32": np.dtype(np.uint32), "u16": np.dtype(np.uint16), "u8": np.dtype(np.uint8),
    "u4": np.dtype(np.uint8), "i4": np.dtype(np.int8), "u2": np.dtype(np.uint8), "u1": np.dtype(np.uint8),
    "boolean": np.dtype(np.bool_),
}


def to_dtype(etype: ov.Type | str) -> np.dtype:
    name = etype if isinstance(etype, str) else etype.get_type_name()
    try:
        return DTYPES[name]
    except KeyError:
        raise NotImplementedError(f"element type {name} is not supported by kvc's interpreter") from None


@dataclass(frozen=True)
class NodeSpec:
    """What a kernel factory may know about its node: everything static, nothing computed."""

    type: str
    version: str
    name: str
    attrs: dict = field(hash=False)
    input_types: tuple[np.dtype, ...]
    output_types: tuple[np.dtype, ...]
    output_shapes: tuple[tuple[int | None, ...] | None, ...]  # None: dynamic rank; None dim: dynamic
    input_shapes: tuple[tuple[int | None, ...] | None, ...] = ()
    # OpenVINO's names of the output element types ("bf16", "i4", ...): for kernels whose result
    # depends on a type numpy lacks and kvc computes in a wider one (see DTYPES).
    output_etypes: tuple[str, ...] = ()

    @property
    def out_dtype(self) -> np.dtype:
        return self.output_types[0]


_TABLE: dict[tuple[str, str | None], Factory] = {}


def register(op_type: str, *versions: str) -> Callable[[Factory], Factory]:
    """Register a kernel factory for `op_type`, for the given opset versions or for all."""

    def deco(factory: Factory) -> Factory:
        for v in versions or (None,):
            key = (op_type, v)
            if key in _TABLE:
                raise ValueError(f"op {op_type} {v or '(any version)'} registered twice")
            _TABLE[key] = factory
        return factory

    return deco


def lookup(op_type: str, version: str) -> Factory | None:
    return _TABLE.get((op_type, version)) or _TABLE.get((op_type, None))


def registered() -> list[tuple[str, str | None]]:
    return sorted(_TABLE, key=lambda k: (k[0], k[1] or ""))


def static_dims(shape: ov.Shape) -> tuple[int, ...]:
    """A static shape as a tuple, read from its text ("[1,4,16,64]"): iterating an ov.Shape
    costs ~14 us a shape in the bindings, its text 0.6 (a numpy open of the bench model's five
    models read 17 600 shapes: 0.25 s, now 0.03)."""
    text = shape.to_string()
    return tuple(int(d) for d in text[1:-1].split(",")) if text != "[]" else ()


def spec_of(node: ov.Node) -> NodeSpec:
    def shape(ps: ov.PartialShape):
        if ps.is_static:
            return static_dims(ps.to_shape())
        if ps.rank.is_dynamic:
            return None
        return tuple(d.get_length() if d.is_static else None for d in ps)

    return NodeSpec(
        type=node.get_type_name(),
        version=node.get_type_info().version_id,
        name=node.get_friendly_name(),
        attrs=dict(node.get_attributes()),
        input_types=tuple(_maybe_dtype(node.get_input_element_type(i)) for i in range(node.get_input_size())),
        output_types=tuple(_maybe_dtype(node.get_output_element_type(i)) for i in range(node.get_output_size())),
        output_shapes=tuple(shape(node.get_output_partial_shape(i)) for i in range(node.get_output_size())),
        input_shapes=tuple(shape(node.get_input_partial_shape(i)) for i in range(node.get_input_size())),
        output_etypes=tuple(node.get_output_element_type(i).get_type_name() for i in range(node.get_output_size())),
    )


def _maybe_dtype(etype: ov.Type):
    try:
        return to_dtype(etype)
    except NotImplementedError:
        return None
