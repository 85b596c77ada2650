"""kvc's own ops (`kvc.ir.custom_ops`), through the same reference function OpenVINO's
`evaluate` calls, so the interpreter and the CPU plugin cannot disagree on their meaning."""

from __future__ import annotations

from kvc.ir.custom_ops import kvcache_reference
from kvc.runtime.ops.registry import NodeSpec, register


@register("KVCache", "kvc")
def kvcache(spec: NodeSpec):
    a = spec.attrs
    kw = dict(concat_axis=int(a["concat_axis"]), gather_axis=int(a["gather_axis"]), indirect=bool(a["indirect"]))

    def run(*inputs):
        out = kvcache_reference(*inputs, **kw)
        return out[0] if len(out) == 1 else tuple(out)

    return run
