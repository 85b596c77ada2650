"""The attention/KV subgraph of one layer, small enough to draw.

Anchors: the layer's cache as it enters (a stateful model's ReadValue of the layer's
variables; a stateless model's ``past_key_values.<L>.*`` Parameters) and as it leaves (the
Assigns of those variables; the ``present.<L>.*`` Results). The rules:

* a model without cache inputs (an unchunked prefill) starts instead where each exit's chain
  of single-consumer ops branches off (this step's keys and values on their way to attention);
* from each entry anchor, the first attention op downstream is its target: a
  ScaledDotProductAttention, or a MatMul (the cache never meets a weight MatMul before
  attention, so the first MatMul is Q·Kᵀ for the key and P·V for the value);
* an unfused attention is followed from Q·Kᵀ through its Softmax to the next MatMul (P·V);
* drawn: every op on a path from an entry anchor to a target, on a path between targets (the
  Softmax of an unfused attention), and on a path from those or their direct inputs to an exit
  anchor (a present output computed from this step's keys);
* Constants and shape arithmetic (ShapeOf and what only it feeds) are left out;
* the direct non-constant inputs of drawn ops that are not drawn themselves (the query, this
  step's new rows, beam_idx, the mask) are drawn as context, dashed;
* at most `MAX_NODES` ops; beyond that the nearest to the anchors are kept and the rest counted.

Nodes are keyed by `kvc.ir.naming`'s stable names, so the same model gives the same picture.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import networkx as nx

from kvc.errors import InvalidModelError

MAX_NODES = 48
ATTENTION = {"ScaledDotProductAttention", "MatMul"}
SKIP = {"Constant", "ShapeOf"}


@dataclass(frozen=True)
class Node:
    key: str  # stable name (kvc.ir.naming)
    type: str
    friendly_name: str
    out_type: str
    role: str  # "past", "present", "kv", "attention", "op", "context"


@dataclass(frozen=True)
class Subgraph:
    nodes: tuple[Node, ...]  # sorted by key
    edges: tuple[tuple[str, str], ...]  # sorted
    omitted: int = 0  # ops on the paths left out (MAX_NODES)


def _view(model):
    from kvc.ir.naming import name_model
    from kvc.ir.nxview import graph

    naming = name_model(model)
    return naming, graph(model, naming)


def kv_subgraph_source(model, layer: int, file: str) -> Subgraph:
    """Layer `layer`'s KV subgraph in a model before lifting (stateful, or a stateless
    export with past/present)."""
    from kvc.ir.kv_discovery import kv_layout

    naming, g = _view(model)
    tensors = [t for t in kv_layout(model, file).tensors if t.layer == layer]
    if not tensors:
        raise InvalidModelError("no-layer", file, f"no KV cache tensors for layer {layer}")
    if any(t.variable_id for t in tensors):
        ids = {t.variable_id for t in tensors}
        entry = [k for k, d in g.nodes(data=True)
                 if d["type"] == "ReadValue" and d["attrs"].get("variable_id") in ids]
        exit_ = [k for k, d in g.nodes(data=True)
                 if d["type"] == "Assign" and d["attrs"].get("variable_id") in ids]
        return _subgraph(g, entry, exit_)
    return _subgraph(g, *_port_anchors(model, naming, [t.input_name for t in tensors],
                                       [t.output_name for t in tensors]))


def kv_subgraph_final(model, specs, file: str) -> Subgraph:
    """The subgraph in a final static model, anchored on the plan's KV inputs and outputs
    (`specs`: the `kvc.plan.KVSpec`s of one layer; a prefill has no past input when it runs
    unchunked, and then only its present outputs anchor it)."""
    naming, g = _view(model)
    entry, exit_ = _port_anchors(model, naming, [s.input for s in specs], [s.output for s in specs])
    if not entry and not exit_:
        raise InvalidModelError("no-kv-ports", file, "none of the plan's KV inputs or outputs is a port of the model",
                                expected=", ".join(s.input for s in specs))
    return _subgraph(g, entry, exit_)


def _port_anchors(model, naming, inputs, outputs) -> tuple[list[str], list[str]]:
    wanted_in, wanted_out = {n for n in inputs if n}, {n for n in outputs if n}
    entry = [naming.key[p] for p in model.get_parameters() if p.output(0).get_names() & wanted_in]
    exit_ = [naming.key[o.get_node()] for o in model.outputs if o.get_names() & wanted_out]
    return entry, exit_


def _subgraph(g: nx.MultiDiGraph, entry: list[str], exit_: list[str]) -> Subgraph:
    flow = g.subgraph([k for k, d in g.nodes(data=True) if d["type"] not in SKIP])
    entry, exit_ = sorted(set(entry)), sorted(set(exit_))
    sources = entry or _branch_points(flow, exit_)
    targets = set()
    for anchor in sources:
        hit = next((n for n in nx.bfs_tree(flow, anchor) if n != anchor and flow.nodes[n]["type"] in ATTENTION), None)
        if hit is not None:
            targets.add(hit)
    for qk in sorted(t for t in targets if flow.nodes[t]["type"] == "MatMul"):  # on through Softmax to P·V
        softmax = next((n for n in nx.bfs_tree(flow, qk, depth_limit=8) if flow.nodes[n]["type"] == "Softmax"), None)
        if softmax is not None:
            pv = next((n for n in nx.bfs_tree(flow, softmax, depth_limit=8) if flow.nodes[n]["type"] == "MatMul"), None)
            if pv is not None:
                targets.add(pv)
    drawn = _on_paths(flow, set(sources), targets) | _on_paths(flow, targets, targets) | set(sources)
    around = drawn | {p for n in drawn - set(entry) for p in flow.predecessors(n)}
    drawn |= _on_paths(flow, around, set(exit_)) | set(exit_)
    drawn, omitted = _nearest(flow, drawn, set(entry) | set(exit_))
    context = sorted({p for n in drawn for p in flow.predecessors(n)} - drawn)
    nodes = []
    for key in sorted(drawn | set(context)):
        d = flow.nodes[key]
        role = ("past" if key in entry else "present" if key in exit_
                else "context" if key in context or d["type"] == "Parameter"
                else "attention" if d["type"] in ATTENTION | {"Softmax"} else
                "kv" if d["type"] in ("Concat", "Gather", "KVCache", "ReadValue", "Assign") else "op")
        out_type = ", ".join(t for _, t in d["outputs"])
        nodes.append(Node(key, d["type"], d["friendly_name"], out_type, role))
    keys = {n.key for n in nodes}
    edges = sorted({(a, b) for a, b in flow.edges() if a in keys and b in keys and b in drawn})
    return Subgraph(tuple(nodes), tuple(edges), omitted)


def _branch_points(g, exits: list[str]) -> list[str]:
    """Where this step's cache rows leave for attention, for a model without past inputs (an
    unchunked prefill): up each exit's chain of single-consumer ops to the first op whose
    output also goes elsewhere."""
    points = set()
    for e in exits:
        node = next(iter(g.predecessors(e)), None)
        while node is not None and g.out_degree(node) == 1 and g.in_degree(node) >= 1:
            node = next(iter(sorted(g.predecessors(node))))
        if node is not None:
            points.add(node)
    return sorted(points)


def _on_paths(g, sources: set[str], sinks: set[str]) -> set[str]:
    """Nodes on some directed path from a node of `sources` to a node of `sinks`."""
    if not sources or not sinks:
        return set()
    down = set(sources)
    for s in sources:
        down |= nx.descendants(g, s)
    up = set(sinks)
    for t in sinks:
        up |= nx.ancestors(g, t)
    return down & up


def _nearest(g, drawn: set[str], anchors: set[str]) -> tuple[set[str], int]:
    """At most MAX_NODES of `drawn`, the nearest to the anchors (undirected, within `drawn`)."""
    if len(drawn) <= MAX_NODES:
        return drawn, 0
    sub = g.subgraph(drawn).to_undirected(as_view=True)
    seen, queue = [], deque(sorted(anchors & drawn))
    visited = set(queue)
    while queue and len(seen) < MAX_NODES:
        n = queue.popleft()
        seen.append(n)
        for m in sorted(sub.neighbors(n)):
            if m not in visited:
                visited.add(m)
                queue.append(m)
    return set(seen), len(drawn) - len(seen)
