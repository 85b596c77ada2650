"""Stable names and a canonical order for the nodes and values of an `ov.Model`.

Friendly names such as ``ReadValue_15226`` come from a per-process counter, so they cannot
identify anything across runs (REFERENCE.md §1). kvc names every value, in this order of
preference, by:

1. its tensor names (``logits``, ``present.0.key``): the stable identities exporters give;
2. the node's friendly name when it is not counter-made (``self.model.embed_tokens.weight``);
3. a short hash of what defines it: op type, version, attributes and the names of its inputs
   (for a Constant: its element type, shape and bytes). Equal structure gives equal names in
   any process, and a local change renames only the unnamed values downstream of it.

The order is a depth-first post-order from the outputs (Results in model order, then sinks
by variable id), inputs visited by port: it depends on the graph, not on how a pass happened
to build it, so a local rewrite moves only local lines.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import numpy as np
import openvino as ov

_COUNTER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]*_\d+$")
_PLAIN = re.compile(r"^[A-Za-z0-9_.:/#~\-\[\]]+$")


def op_version(node: ov.Node) -> str:
    return node.get_type_info().version_id


def is_counter_name(name: str) -> bool:
    """True for names like ``Constant_15480`` that OpenVINO derives from a process counter."""
    return bool(_COUNTER_NAME.match(name))


def best_tensor_name(names) -> str | None:
    """The most readable of a tensor's names: words before numbers, then shortest, then sorted."""
    if not names:
        return None
    return min(names, key=lambda n: (n.isdigit(), len(n), n))


def format_value(v) -> str:
    """Attribute values printed the same way in every process and OpenVINO build."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple, np.ndarray)):
        return "[" + ",".join(format_value(x) for x in list(v)) + "]"
    if isinstance(v, (float, np.floating)):
        return repr(float(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    s = str(v)
    return s if _PLAIN.match(s) else '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def format_type(etype: ov.Type, pshape: ov.PartialShape) -> str:
    if pshape.is_static:  # OpenVINO prints static shapes as kvc does, 20x faster
        return etype.get_type_name() + str(pshape)
    if pshape.rank.is_dynamic:
        dims = "..."
    else:
        dims = ",".join(_format_dim(d) for d in pshape)
    return f"{etype.get_type_name()}[{dims}]"


def _format_dim(d: ov.Dimension) -> str:
    if d.is_static:
        return str(d.get_length())
    lo, hi = d.get_min_length(), d.get_max_length()
    if lo <= 0 and hi < 0:
        return "?"
    return f"{lo}..{'' if hi < 0 else hi}"


def const_digest(node: ov.Node) -> str:
    """A short content hash of a Constant's bytes (packed low-bit types hash their packing)."""
    data = np.ascontiguousarray(node.get_data())
    h = hashlib.blake2b(digest_size=5)
    h.update(data.view(np.uint8).reshape(-1).data if data.size else b"")
    return h.hexdigest()


def node_attributes(node: ov.Node) -> dict:
    """Attributes that define the node's semantics (shape/type of Constants and Parameters live
    in the printed output type, so they are dropped here)."""
    attrs = dict(node.get_attributes())
    if node.get_type_name() in ("Constant", "Parameter"):
        attrs.pop("element_type", None)
        attrs.pop("shape", None)
    return attrs


@dataclass
class Naming:
    """Canonical order plus a stable name for every node (`key`) and value (`value`)."""

    order: list[ov.Node] = field(default_factory=list)
    key: dict[ov.Node, str] = field(default_factory=dict)
    # Nodes structurally identical to an earlier one (same hash name): printed once.
    duplicates: set[ov.Node] = field(default_factory=set)
    _values: dict[tuple[ov.Node, int], str] = field(default_factory=dict)

    def value(self, output: ov.Output) -> str:
        return self._values[(output.get_node(), output.get_index())]

    def input_names(self, node: ov.Node) -> list[str]:
        return [self.value(i.get_source_output()) for i in node.inputs()]


def canonical_order(model: ov.Model) -> list[ov.Node]:
    """Parameters in model order, then every other node in DFS post-order from the outputs."""
    roots = list(model.get_results())
    roots += sorted(model.get_sinks(), key=_sink_sort_key)
    seen: set[ov.Node] = set(model.get_parameters())
    order: list[ov.Node] = list(model.get_parameters())
    for root in roots:
        stack: list[tuple[ov.Node, int]] = [(root, 0)]
        while stack:
            node, i = stack.pop()
            if node in seen and i == 0:
                continue
            inputs = node.inputs()
            if i < len(inputs):
                stack.append((node, i + 1))
                src = inputs[i].get_source_output().get_node()
                if src not in seen:
                    stack.append((src, 0))
                continue
            seen.add(node)
            order.append(node)
    return order


def _sink_sort_key(node: ov.Node) -> str:
    attrs = node.get_attributes()
    return str(attrs.get("variable_id", node.get_friendly_name()))


def name_model(model: ov.Model) -> Naming:
    naming = Naming(order=canonical_order(model))
    taken: set[str] = set()

    def unique(name: str) -> str:
        if name not in taken:
            taken.add(name)
            return name
        k = 2
        while f"{name}~{k}" in taken:
            k += 1
        taken.add(f"{name}~{k}")
        return f"{name}~{k}"

    result_names = {r: model.output(i).get_names() for i, r in enumerate(model.get_results())}
    sinks = set(model.get_sinks())
    for node in naming.order:
        if node in result_names:
            naming.key[node] = naming._values[(node, 0)] = unique(
                "output:" + (best_tensor_name(result_names[node]) or node.get_friendly_name()))
        elif node in sinks:  # Assign: its output is never consumed, so it is named by its variable
            naming.key[node] = unique("sink:" + _sink_sort_key(node))
            for port in range(node.get_output_size()):
                naming._values[(node, port)] = naming.key[node]
        elif node.get_output_size() == 1:
            base, hashed = _base_name(node, naming)
            if hashed and base in taken:  # same structure, same value: one name, one line
                naming.duplicates.add(node)
                naming.key[node] = naming._values[(node, 0)] = base
            else:
                naming.key[node] = naming._values[(node, 0)] = unique(base)
        else:
            key = naming.key[node] = unique(_base_name(node, naming)[0])
            for port in range(node.get_output_size()):
                name = best_tensor_name(node.output(port).get_names()) or f"{key}.{port}"
                naming._values[(node, port)] = unique(name)
    return naming


def _base_name(node: ov.Node, naming: Naming) -> tuple[str, bool]:
    """The node's own name (friendly name if meaningful, else a structural hash) and
    whether it is a hash."""
    if node.get_output_size() == 1:
        tensor_name = best_tensor_name(node.output(0).get_names())
        if tensor_name is not None:
            return tensor_name, False
    friendly = node.get_friendly_name()
    if friendly and not is_counter_name(friendly):
        return friendly, False
    tname = node.get_type_name()
    h = hashlib.blake2b(digest_size=4)
    if tname == "Constant":
        etype = node.get_output_element_type(0).get_type_name()
        h.update(f"{format_type(node.get_output_element_type(0), node.get_output_partial_shape(0))}|"
                 f"{const_digest(node)}".encode())
        return f"c.{etype}#{h.hexdigest()}", True
    h.update(f"{tname}|{op_version(node)}".encode())
    for k, v in sorted(node_attributes(node).items()):
        h.update(f"|{k}={format_value(v)}".encode())
    for name in naming.input_names(node):
        h.update(f"|<{name}".encode())
    return f"{tname}#{h.hexdigest()}", True


def hashed_name(node: ov.Node) -> str:
    """The stable name `canonicalize_friendly_names` gives a node with a counter name (before any
    ``~k``): ``<Type>#<hash>`` over its type, version and, for a Constant, its type, shape and
    bytes, else its attributes and the names of the nodes feeding it."""
    tname = node.get_type_name()
    h = hashlib.blake2b(digest_size=4)
    h.update(f"{tname}|{op_version(node)}".encode())
    if tname == "Constant":
        h.update(f"|{format_type(node.get_output_element_type(0), node.get_output_partial_shape(0))}"
                 f"|{const_digest(node)}".encode())
    else:
        for k, v in sorted(node_attributes(node).items()):
            h.update(f"|{k}={format_value(v)}".encode())
        for inp in node.inputs():
            src = inp.get_source_output()
            h.update(f"|<{src.get_node().get_friendly_name()}:{src.get_index()}".encode())
    return f"{tname}#{h.hexdigest()}"


def canonicalize_friendly_names(model: ov.Model, ops: list[ov.Node] | None = None) -> int:
    """Replace counter-made friendly names (``Constant_2638``) by stable ones, so a saved file
    does not depend on which process built the model. Returns how many changed.

    A renamed node is called ``<Type>#<hash>`` over its type, version, attributes and the
    (already stable) names of the nodes feeding it, or, for a Constant, its type, shape and
    bytes. Friendly names carry no semantics (inputs and outputs are found by tensor name).
    `ops` is `model.get_ordered_ops()` if the caller has it already."""
    changed, taken = 0, set()
    next_suffix: dict[str, int] = {}  # hashed name -> the first ~k not yet tried
    for node in model.get_ordered_ops() if ops is None else ops:
        name = node.get_friendly_name()
        if not is_counter_name(name):
            taken.add(name)
            continue
        new = base = hashed_name(node)
        if new in taken:  # structurally equal nodes: ~2, ~3, ... in order
            k = next_suffix.get(base, 2)
            while f"{base}~{k}" in taken:
                k += 1
            new, next_suffix[base] = f"{base}~{k}", k + 1
        taken.add(new)
        node.set_friendly_name(new)
        changed += 1
    return changed
