"""The canonical text form of a model: what dumps, diffs and golden IR tests compare.

One line per op, in the canonical order of `kvc.ir.naming`:

    %q.1 = Transpose<opset1>(%177, %c.i32#1f0c22aa) : f32[?,4,?,16]
    %c.i64#0b6e2c91 = Constant<opset1> [0,2,1,3] : i64[4]
    %self.model.norm.weight = Constant<opset1> #5e0d7a1c02 : f32[64]

Attributes are sorted, constants show their values when small (≤ 16 elements) and a content
hash otherwise; inputs, outputs, variables and model rt_info (without version strings) head
the text. Nothing in it depends on the process that produced it.
"""

from __future__ import annotations

import numpy as np
import openvino as ov

from kvc.ir.naming import (
    Naming,
    const_digest,
    format_type,
    format_value,
    name_model,
    node_attributes,
    op_version,
)
from kvc.ir.text_embeddings import RT_KEY

HEADER = "# kvc ir text v1"
INLINE_CONST_ELEMENTS = 16
# rt_info entries that only say which tool versions wrote the file, or where on this machine
# kvc found the text embeddings model (kvc.ir.text_embeddings).
_VERSION_RT_KEYS = {"OpenVINO Runtime", "Runtime_version", "version", "optimum", "conversion_parameters", RT_KEY}


def to_text(model: ov.Model, naming: Naming | None = None) -> str:
    naming = naming or name_model(model)
    lines = [HEADER]
    for param in model.get_parameters():
        out = param.output(0)
        lines.append(f"input %{naming.value(out)} : {format_type(out.get_element_type(), out.get_partial_shape())}")
    for i, out in enumerate(model.outputs):
        names = ",".join(sorted(out.get_names())) or f"#{i}"
        lines.append(f"output {names} : {format_type(out.get_element_type(), out.get_partial_shape())}")
    for var in sorted(model.get_variables(), key=lambda v: v.get_info().variable_id):
        info = var.get_info()
        lines.append(f"variable {format_value(info.variable_id)} : "
                     f"{format_type(info.data_type, info.data_shape)}")
    for key, value in _flat_rt_info(model):
        lines.append(f"rt_info {key} = {format_value(value)}")
    lines.append("")
    results = {r: i for i, r in enumerate(model.get_results())}
    sinks = set(model.get_sinks())
    for node in naming.order:
        if node.get_type_name() == "Parameter" or node in naming.duplicates:
            continue
        if node in results:
            out = model.outputs[results[node]]
            names = ",".join(sorted(out.get_names())) or f"#{results[node]}"
            lines.append(f"return {names} = %{naming.input_names(node)[0]}")
            continue
        lines.append(op_line(node, naming, sink=node in sinks))
    return "\n".join(lines) + "\n"


def op_line(node: ov.Node, naming: Naming, sink: bool = False) -> str:
    """One op as text: results, op type and version, attributes, inputs, output types."""
    tname = node.get_type_name()
    head = f"{tname}<{op_version(node)}>"
    attrs = node_attributes(node)
    if attrs:
        head += "{" + ", ".join(f"{k}={format_value(v)}" for k, v in sorted(attrs.items())) + "}"
    if tname == "Constant":
        body = " " + _const_summary(node)
    else:
        body = "(" + ", ".join("%" + n for n in naming.input_names(node)) + ")"
    outs = [node.output(i) for i in range(node.get_output_size())]
    if sink or not outs:
        return f"sink {head}{body}"
    lhs = ", ".join("%" + naming.value(o) for o in outs)
    types = ", ".join(format_type(o.get_element_type(), o.get_partial_shape()) for o in outs)
    return f"{lhs} = {head}{body} : {types}"


def _const_summary(node: ov.Node) -> str:
    etype = node.get_output_element_type(0)
    shape = node.get_output_partial_shape(0)
    count = int(np.prod([d.get_length() for d in shape])) if shape.rank.get_length() else 1
    if count <= INLINE_CONST_ELEMENTS and etype.bitwidth >= 8 and etype.get_type_name() != "string":
        data = np.asarray(node.get_data()).reshape(-1)
        return format_value(data.tolist())
    return "#" + const_digest(node)


def _flat_rt_info(model: ov.Model) -> list[tuple[str, object]]:
    """Model rt_info as sorted `a.b = value` pairs, without the tool-version entries."""
    rt = model.get_rt_info()
    out: list[tuple[str, object]] = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k in sorted(value):
                walk(f"{prefix}.{k}" if prefix else str(k), value[k])
        else:
            out.append((prefix, value.astype(str) if hasattr(value, "astype") else str(value)))

    for key in sorted(rt.keys()):
        if key not in _VERSION_RT_KEYS:
            walk(key, rt[key])
    return out
