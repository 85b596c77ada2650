"""A model at a glance: what `kvc inspect` shows and manifests record."""

from __future__ import annotations

from collections import Counter

import numpy as np
import openvino as ov

from kvc.errors import InvalidModelError
from kvc.ir.kv_discovery import kv_layout
from kvc.ir.naming import format_type

# Constants smaller than this are shape arithmetic and scalars, not weights.
_MIN_WEIGHT_ELEMENTS = 16


def port_info(ports) -> list[dict]:
    return [{"names": sorted(p.get_names()), "type": format_type(p.get_element_type(), p.get_partial_shape())}
            for p in ports]


def describe(model: ov.Model, file: str = "<model>") -> dict:
    """Inputs, outputs, variables, op counts, weights and the KV layout (None if no cache)."""
    weights = weight_bytes = 0
    for op in model.get_ops():
        if op.get_type_name() != "Constant":
            continue
        count = int(np.prod(op.get_output_shape(0))) if len(op.get_output_shape(0)) else 1
        if count >= _MIN_WEIGHT_ELEMENTS:
            weights += count
            weight_bytes += op.get_byte_size()
    try:
        layout = kv_layout(model, file).to_dict()
    except InvalidModelError as exc:
        if exc.code != "no-kv-cache":
            raise
        layout = None
    return {
        "name": model.get_friendly_name(),
        "inputs": port_info(model.inputs),
        "outputs": port_info(model.outputs),
        "variables": sorted(v.get_info().variable_id for v in model.get_variables()),
        "op_counts": dict(sorted(Counter(n.get_type_name() for n in model.get_ops()).items())),
        "parameters": weights,
        "weight_bytes": weight_bytes,
        "kv_layout": layout,
    }
