"""kvc's own OpenVINO ops, defined in Python so every OpenVINO tool can carry them.

`KVCache` is the fused form of the per-layer `[Gather(beam_idx)] → Concat` KV-cache update
(the GPU plugin's KVCacheFusion, REFERENCE.md §3), with reference semantics in `evaluate`:

    inputs   0 past         [.., S_past, ..]         the cache so far
             1 new          [.., S_new, ..]          this step's keys or values
             2 beam_idx     i32 [B]                  optional: which beam each batch row continues
             3 beam_table   i32 [B, S_past]          indirect only: batch row each past position lives in
    outputs  0 cache        concat(reorder(past), new) along concat_axis; with indirect=1 the past is
                            NOT reordered (it stays where it was written)
             1 beam_table   indirect only, i32 [B, S_past + S_new]:
                            bt[b, s] = beam_table[beam_idx[b], s] for s < S_past, and b for new rows

Reading position s of batch b of an indirect cache means reading `cache[bt[b, s], ..., s, ...]`;
kvc's fuse pass inserts that read as a standard GatherElements before attention.

A Python op cannot own an OpenVINO variable, so in a stateful model the Assign stays after the
KVCache (the GPU plugin's C++ op absorbs it). The domain is ``kvc``: the IR says
``type="KVCache" version="kvc"`` and `kvc.ir.reader` registers the op before reading.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
from openvino import Op

DOMAIN = "kvc"


def kvcache_reference(past, new, beam_idx=None, beam_table=None, *, concat_axis: int,
                      gather_axis: int, indirect: bool):
    """The numpy definition of KVCache; `evaluate` and kvc's runtime both call this."""
    if indirect:
        assert beam_idx is not None and beam_table is not None, "indirect KVCache needs beam_idx and beam_table"
        batch = new.shape[gather_axis]
        s_new = new.shape[concat_axis]
        bt_dtype = beam_table.dtype
        reordered = beam_table[beam_idx.astype(np.int64)] if beam_table.shape[1] else beam_table[:batch]
        fresh = np.repeat(np.arange(batch, dtype=bt_dtype)[:, None], s_new, axis=1)
        return [np.concatenate([past, new], axis=concat_axis),
                np.concatenate([reordered.astype(bt_dtype), fresh], axis=1)]
    if beam_idx is not None:
        past = np.take(past, beam_idx.astype(np.int64), axis=gather_axis)
    return [np.concatenate([past, new], axis=concat_axis)]


class KVCache(Op):
    """Fused KV-cache update: optional beam reorder (physical or indirect) then concat."""

    _TYPE = ov.DiscreteTypeInfo("KVCache", DOMAIN)

    @classmethod
    def get_type_info(cls):
        return cls._TYPE

    def __init__(self, inputs=None, attrs=None):
        super().__init__(self)
        attrs = attrs or {}
        self._concat_axis = int(attrs.get("concat_axis", 2))
        self._gather_axis = int(attrs.get("gather_axis", 0))
        self._indirect = _as_bool(attrs.get("indirect", False))
        if inputs:
            self.set_arguments(inputs)
            self.constructor_validate_and_infer_types()

    @property
    def concat_axis(self) -> int:
        return self._concat_axis

    @property
    def gather_axis(self) -> int:
        return self._gather_axis

    @property
    def indirect(self) -> bool:
        return self._indirect

    def validate_and_infer_types(self):
        n = self.get_input_size()
        want = 4 if self._indirect else (2, 3)
        if (n != want) if isinstance(want, int) else (n not in want):
            raise ValueError(f"KVCache(indirect={self._indirect}) takes {want} inputs, got {n}")
        past, new = self.get_input_partial_shape(0), self.get_input_partial_shape(1)
        rank = past.rank.get_length() if past.rank.is_static else None
        axis = self._concat_axis
        if rank is not None and axis < 0:
            axis += rank
        out = ov.PartialShape(past)
        if rank is not None:
            if new.rank.is_static and new.rank.get_length() == rank:
                for i in range(rank):
                    if i != axis and not out[i].is_static and new[i].is_static:
                        out[i] = new[i]
            dp, dn = past[axis], new[axis] if new.rank.is_static else ov.Dimension()
            out[axis] = (ov.Dimension(dp.get_length() + dn.get_length())
                         if dp.is_static and dn.is_static else ov.Dimension())
        self.set_output_type(0, self.get_input_element_type(0), out)
        if self._indirect:
            batch = out[self._gather_axis] if rank is not None else ov.Dimension()
            self.set_output_type(1, self.get_input_element_type(3),
                                 ov.PartialShape([batch, out[axis] if rank is not None else ov.Dimension()]))

    def clone_with_new_inputs(self, new_inputs):
        return KVCache(new_inputs, self._attrs())

    def _attrs(self) -> dict:
        return {"concat_axis": self._concat_axis, "gather_axis": self._gather_axis,
                "indirect": self._indirect}

    def visit_attributes(self, visitor):
        # The same call serves writing and reading: when reading an IR, OpenVINO's visitor
        # overwrites the dict's values in place with what the file says.
        values = self._attrs()
        visitor.on_attributes(values)
        self._concat_axis = int(values["concat_axis"])
        self._gather_axis = int(values["gather_axis"])
        self._indirect = _as_bool(values["indirect"])
        return True

    def has_evaluate(self):
        return True

    def evaluate(self, outputs, inputs):
        arrays = [t.data for t in inputs]
        results = kvcache_reference(*arrays, concat_axis=self._concat_axis,
                                    gather_axis=self._gather_axis, indirect=self._indirect)
        for tensor, value in zip(outputs, results):
            tensor.shape = value.shape
            tensor.data[...] = value
        return True


def _as_bool(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)


CUSTOM_OPS = (KVCache,)


def register_extensions(core: ov.Core) -> None:
    """Make `core` able to read, run and save models that contain kvc's ops."""
    for op in CUSTOM_OPS:
        core.add_extension(ov.OpExtension(op))
