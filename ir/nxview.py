"""A networkx view of an `ov.Model`, for analyses that want graph algorithms.

Nodes are keyed by the stable names of `kvc.ir.naming` (never by friendly names or object
ids), so two processes build equal graphs. The view is read-only: rewrites go through
OpenVINO, which re-validates shapes and types after every change.
"""

from __future__ import annotations

import networkx as nx
import openvino as ov

from kvc.ir.naming import Naming, format_type, name_model, node_attributes, op_version


def graph(model: ov.Model, naming: Naming | None = None) -> nx.MultiDiGraph:
    """Nodes carry type, version, attributes, friendly name and the `ov.Node`; edges carry
    source and destination ports and the element type and shape flowing along them."""
    naming = naming or name_model(model)
    g = nx.MultiDiGraph(name=model.get_friendly_name())
    for node in naming.order:
        key = naming.key[node]
        if key in g:  # a structural duplicate (see Naming.duplicates): one node in the view
            continue
        g.add_node(key, type=node.get_type_name(), version=op_version(node),
                   attrs=node_attributes(node), friendly_name=node.get_friendly_name(), node=node,
                   outputs=[(naming.value(o), format_type(o.get_element_type(), o.get_partial_shape()))
                            for o in node.outputs()])
    for node in naming.order:
        dst = naming.key[node]
        for inp in node.inputs():
            src_out = inp.get_source_output()
            src = naming.key[src_out.get_node()]
            g.add_edge(src, dst, key=f"{src_out.get_index()}->{inp.get_index()}",
                       src_port=src_out.get_index(), dst_port=inp.get_index(),
                       element_type=src_out.get_element_type().get_type_name(),
                       shape=str(src_out.get_partial_shape()))
    return g
