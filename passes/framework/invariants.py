"""Invariants a pass requires of its input and ensures of its output, by name.

    stateless      no variable, ReadValue or Assign is left (lift-state ensures it)
    static         every output of every op has a static shape (static-shape ensures it)
    static-but-rows  static, or every input static but the row dimension (1) of the token
                   inputs and the attention mask: a first chunk of dynamic rows
                   (static-shape{rows=dynamic} ensures it)
    outputs-but-rows  every output static but at most one dimension, its rows (pin-rows
                   ensures it)
    standard-ops   no kvc custom op (KVCache) is left: any OpenVINO device can compile it

Each check returns None when the invariant holds, else the reason naming the first node
that breaks it. The PassManager checks `requires` before a pass runs and `ensures` after it
(always: each check costs about a millisecond), and raises a PassFailure that names the
pass. In check mode (`PassManager(check=True)`, or KVC_CHECK_PASSES=1; the test suite's
pass tests use it) it also holds every pass to `honest`: the model it returns validates with
no stale element type or shape, and `modified` is true exactly when the model's text changed.
"""

from __future__ import annotations

from typing import Callable

import openvino as ov

from kvc.passes.framework.base import describe_node, type_signature


def _stateless(model: ov.Model) -> str | None:
    if model.get_variables():
        names = sorted(v.get_info().variable_id for v in model.get_variables())
        return f"the model is still stateful; run lift-state first ({len(names)} variables: {names[0]}, ...)"
    for node in model.get_ordered_ops():
        if node.get_type_name() in ("ReadValue", "Assign"):
            return f"{describe_node(node)} is left; run lift-state first"
    return None


def _static(model: ov.Model) -> str | None:
    if not model.is_dynamic():  # OpenVINO's own check of every op's inputs: 1 ms
        return None
    for node in model.get_ordered_ops():
        for port in range(node.get_output_size()):
            shape = node.get_output_partial_shape(port)
            if shape.rank.is_dynamic:
                return f"output {port} of {describe_node(node)} has a dynamic rank"
            axis = next((a for a, d in enumerate(shape) if d.is_dynamic), None)
            if axis is not None:
                return (f"output {port} of {describe_node(node)} is still dynamic in dimension {axis} (shape "
                        f"{shape}); a static-shape device cannot run it")
    return None


ROW_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids", "attention_mask")


def _static_but_rows(model: ov.Model) -> str | None:
    if not model.is_dynamic():
        return None
    for port in model.inputs:
        shape = port.get_partial_shape()
        rows = (shape.rank.get_length() - 1 if "position_ids" in port.get_names() and shape.rank.is_static
                else 1) if port.get_names() & set(ROW_INPUTS) else None  # 3-D position_ids: [3, 1, rows]
        if shape.rank.is_dynamic or any(d.is_dynamic for a, d in enumerate(shape) if a != rows):
            return (f"input {port.get_any_name()} is dynamic (shape {shape}) beyond the rows of a token input; a "
                    f"first chunk of dynamic rows has every other dimension static")
    return None


def _outputs_but_rows(model: ov.Model) -> str | None:
    for port in model.outputs:
        shape = port.get_partial_shape()
        if shape.rank.is_dynamic or sum(d.is_dynamic for d in shape) > 1:
            return (f"output {port.get_any_name()} is dynamic (shape {shape}) beyond its rows; run pin-rows (an If "
                    f"pads each dynamic dimension of a first chunk's outputs to its rows)")
    return None


def _standard_ops(model: ov.Model) -> str | None:
    from kvc.ir.custom_ops import CUSTOM_OPS

    custom = {op.__name__ for op in CUSTOM_OPS}
    for node in model.get_ordered_ops():
        if node.get_type_name() in custom:
            return f"{describe_node(node)} is a kvc op no device knows; run lower-kvcache"
    return None


INVARIANTS: dict[str, Callable[[ov.Model], str | None]] = {
    "stateless": _stateless,
    "static": _static,
    "static-but-rows": _static_but_rows,
    "outputs-but-rows": _outputs_but_rows,
    "standard-ops": _standard_ops,
}


def check(names: tuple[str, ...], model: ov.Model) -> tuple[str, str] | None:
    """The first invariant of `names` that `model` breaks, with the reason; None if all hold."""
    for name in names:
        if name not in INVARIANTS:
            raise ValueError(f"unknown invariant {name!r}; known: {', '.join(INVARIANTS)}")
        reason = INVARIANTS[name](model)
        if reason is not None:
            return name, reason
    return None


def stale_types(model: ov.Model) -> str | None:
    """Validate the model again; name the first op whose element type or shape was stale
    (what a pass left behind when it rewired a node without inferring it again)."""
    nodes = model.get_ordered_ops()
    before = [type_signature(node) for node in nodes]
    try:
        model.validate_nodes_and_infer_types()
    except RuntimeError as exc:
        return f"the model no longer validates: {str(exc).strip().splitlines()[0]}"
    for node, old in zip(nodes, before):
        now = type_signature(node)
        if now != old:
            port = next(i for i, (a, b) in enumerate(zip(old, now)) if a != b)
            was, found = ("".join(old[port]), "".join(now[port]))
            return (f"output {port} of {describe_node(node)} was {was} before inference and {found} after: "
                    f"the pass rewired it without inferring its type again (kvc.passes.framework.base.reinfer)")
    return None

