"""lower-kvcache: turn kvc's KVCache back into standard opset ops, for targets that do not know it.

    KVCache(past, new)                          -> Concat(past, new)
    KVCache(past, new, beam_idx)                -> Concat(Gather(past, beam_idx, gather_axis), new)
    KVCache(past, new, beam_idx, bt) indirect   -> Concat(past, new),
                                                   Concat(Gather(bt, beam_idx, 0), fresh rows b)

Concat, Gather and the beam-table arithmetic are exact, so fuse followed by lower computes
bit-identical numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult, describe_node
from kvc.passes.fuse_kvcache import fresh_rows, take_over
from kvc.passes.framework.registry import register_pass

log = logging.getLogger(__name__)


@register_pass
@dataclass(frozen=True)
class LowerKVCache(Pass):
    """Replace every KVCache op with Gather/Concat from the standard opsets."""

    name: ClassVar[str] = "lower-kvcache"
    ensures: ClassVar[tuple[str, ...]] = ("standard-ops",)

    def run(self, model: ov.Model) -> PassResult:
        found = [n for n in model.get_ordered_ops() if n.get_type_name() == "KVCache"]
        for kv in found:
            a = kv.get_attributes()
            concat_axis, gather_axis, indirect = int(a["concat_axis"]), int(a["gather_axis"]), bool(a["indirect"])
            past, new = kv.input_value(0), kv.input_value(1)
            base = kv.get_friendly_name()
            if kv.get_input_size() >= 3 and not indirect:
                past = ops.gather(past, kv.input_value(2), ops.constant(np.int64(gather_axis))).output(0)
                past.get_node().set_friendly_name(f"{base}/reorder")
            cache = ops.concat([past, new], concat_axis)
            cache.set_friendly_name(base)
            take_over(kv.output(0), cache.output(0))
            if indirect:
                beam_idx, table = kv.input_value(2), kv.input_value(3)
                rank = new.get_partial_shape().rank.get_length()
                seq = concat_axis + rank if concat_axis < 0 else concat_axis
                old_rows = ops.gather(table, beam_idx, ops.constant(np.int64(0)))
                fresh = fresh_rows(beam_idx, new, seq, table.get_element_type())
                new_table = ops.concat([old_rows, fresh], 1)
                new_table.set_friendly_name(f"{base}/beam_table")
                take_over(kv.output(1), new_table.output(0))
            log.debug("lower-kvcache: lowered %s", describe_node(kv))
        if found:
            model.validate_nodes_and_infer_types()
        return PassResult(model, bool(found))
