"""kvc's IR layer: OpenVINO's `ov.Model` plus what kvc needs around it.

Safe loading (`load`), atomic reproducible saving (`save`), a canonical text form
(`to_text`) and its `diff`, a networkx view (`graph`), KV-cache discovery (`kv_layout`)
and kvc's custom ops (`KVCache`).
"""

from kvc.ir.custom_ops import KVCache
from kvc.ir.compare import diff, summarize
from kvc.ir.kv_discovery import KVLayout, KVTensor, kv_layout
from kvc.ir.reader import core, load, resolve
from kvc.ir.naming import name_model
from kvc.ir.writer import save
from kvc.ir.text import to_text


def graph(model, naming=None):
    """`kvc.ir.nxview.graph`, imported on first use: networkx took 0.26 s of every CLI start."""
    from kvc.ir.nxview import graph as view

    return view(model, naming)


__all__ = ["load", "resolve", "core", "save", "to_text", "diff", "summarize", "graph", "kv_layout",
           "KVLayout", "KVTensor", "KVCache", "name_model"]
