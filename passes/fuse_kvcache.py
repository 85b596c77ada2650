"""fuse-kvcache: replace each cache update with kvc's KVCache op (the GPU plugin's KVCacheFusion).

The pattern, per cache tensor (REFERENCE.md §3), on the stateful form

    ReadValue(v) → [Convert] → [Gather(·, beam_idx, axis)] → Concat(·, new) → [Convert] → Assign(v)

and on the lifted form

    Parameter(past) → [Gather(·, beam_idx, axis)] → Concat(·, new) → [Convert] → Result(present)

becomes ``KVCache(past, new[, beam_idx])``. It matches only when the rewrite keeps meaning:
the ReadValue and the Assign name the same variable, the element type read equals the type
written, and the values between the state and the Concat (the reordered past) feed nothing
else. The rule is `fuse-kvcache/cache-update`; `--debug-rules` says why it did not match at a
store.

``beam=gather`` keeps the physical reorder inside the op. ``beam=indirect`` keeps the cache
where it was written and adds one beam table ``[B, S]`` for the whole model (a variable
``kvc.beam_table``, or an input ``past_beam_table`` and output ``present_beam_table`` on the
lifted form); every consumer of the cache except its store then reads through it with a
standard GatherElements, so the model's outputs do not change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino.op.util import Variable, VariableInfo

from kvc.ir.custom_ops import KVCache
from kvc.passes.framework.base import Pass, PassResult, describe_node, option
from kvc.passes.lift_state import find_beam_idx, set_name
from kvc.passes.framework.registry import register_pass
from kvc.passes.framework.rules import NoMatch, Rule

log = logging.getLogger(__name__)

BEAM_TABLE_VARIABLE = "kvc.beam_table"
BEAM_TABLE_INPUT = "past_beam_table"
BEAM_TABLE_OUTPUT = "present_beam_table"


@dataclass
class Match:
    """One cache update the pass can fuse."""

    concat: ov.Node
    past: ov.Output  # the cache before any reorder (ReadValue/Convert/Parameter output)
    new: ov.Output
    gather: ov.Node | None
    store: ov.Node  # the Assign or Result that keeps the updated cache
    store_input: ov.Input  # where the store (or its Convert) reads the Concat


def _single_user(output: ov.Output, expected: ov.Node, what: str) -> None:
    """Refuse when the value also feeds something other than `expected` (ShapeOf aside: the
    shapes of the past it reads do not change, so it keeps reading it)."""
    users = [t.get_node() for t in output.get_target_inputs()
             if t.get_node() != expected and t.get_node().get_type_name() != "ShapeOf"]
    if users:
        raise NoMatch(f"{what} also feeds {describe_node(users[0])}: fusing it into KVCache would change "
                      "what that consumer reads")


def match_store(store: ov.Node, beam_idx: ov.Node | None) -> Match:
    """Match the pattern backwards from an Assign (stateful) or a Result (lifted)."""
    stored = store.input_value(0)
    store_input = store.input(0)
    if stored.get_node().get_type_name() == "Convert":
        store_input = stored.get_node().input(0)
        stored = stored.get_node().input_value(0)
    concat = stored.get_node()
    if concat.get_type_name() != "Concat" or concat.get_input_size() != 2:
        raise NoMatch(f"{describe_node(store)} does not store a two-input Concat")
    past = concat.input_value(0)
    gather = None
    node = past.get_node()
    if node.get_type_name() == "Gather":
        if beam_idx is None or node.input_value(1).get_node() != beam_idx:
            raise NoMatch(f"{describe_node(node)} reorders the past by something other than beam_idx")
        if node.input_value(2).get_node().get_type_name() != "Constant":
            raise NoMatch(f"{describe_node(node)} has a non-constant axis")
        _single_user(past, concat, f"the reordered past {describe_node(node)}")
        gather, past = node, node.input_value(0)
        node = past.get_node()
    if node.get_type_name() == "Convert" and store.get_type_name() == "Assign":
        _single_user(past, gather or concat, f"the converted past {describe_node(node)}")
        node = node.input_value(0).get_node()
    if store.get_type_name() == "Assign":
        if node.get_type_name() != "ReadValue":
            raise NoMatch(f"the Concat's first input does not come from a ReadValue but from {describe_node(node)}")
        read_id, write_id = node.get_attributes()["variable_id"], store.get_attributes()["variable_id"]
        if read_id != write_id:
            raise NoMatch(f"variable ids differ: ReadValue reads {read_id}, Assign writes {write_id}")
        if node.get_output_element_type(0) != store.get_input_element_type(0):
            raise NoMatch(f"element types differ: read {node.get_output_element_type(0)}, "
                          f"written {store.get_input_element_type(0)}")
    elif node.get_type_name() != "Parameter":
        raise NoMatch(f"the Concat's first input does not come from a model input but from {describe_node(node)}")
    return Match(concat, past, concat.input_value(1), gather, store, store_input)


@register_pass
@dataclass(frozen=True)
class FuseKVCache(Pass):
    """Fuse [Gather(beam_idx)] + Concat cache updates into kvc's KVCache op."""

    name: ClassVar[str] = "fuse-kvcache"
    beam: str = option("gather", choices=("gather", "indirect"),
                       help="gather: reorder the cache physically inside KVCache; indirect: keep it in place "
                            "and read through a beam table")

    def run(self, model: ov.Model) -> PassResult:
        beam_idx = find_beam_idx(model)
        stores = [s for s in model.get_sinks() if s.get_type_name() == "Assign"] or list(model.get_results())
        rule = Rule("fuse-kvcache/cache-update", anchors=("Assign", "Result"),
                    match=lambda store: match_store(store, beam_idx))
        matches = rule.matches(stores)
        if not matches:
            return PassResult(model, False)
        if self.beam == "indirect":
            if beam_idx is None or any(m.gather is None for m in matches):
                raise self.fail("beam=indirect needs every cache reordered by a beam_idx Gather "
                                "(lift the state with beam=keep, or fuse with beam=gather)",
                                next((m.concat for m in matches if m.gather is None), None))
            self._fuse_indirect(model, matches, beam_idx)
        else:
            for m in matches:
                self._fuse(m, beam_idx)
        model.validate_nodes_and_infer_types()
        return PassResult(model, True)

    @staticmethod
    def _kvcache(m: Match, inputs: list, gather_axis: int, indirect: bool) -> KVCache:
        concat_axis = int(m.concat.get_attributes()["axis"])
        kv = KVCache(inputs, {"concat_axis": concat_axis, "gather_axis": gather_axis, "indirect": indirect})
        kv.set_friendly_name(m.concat.get_friendly_name())
        return kv

    def _fuse(self, m: Match, beam_idx: ov.Node | None) -> None:
        inputs = [m.past, m.new]
        gather_axis = 0
        if m.gather is not None:
            inputs.append(beam_idx.output(0))
            gather_axis = _gather_axis(m.gather)
        kv = self._kvcache(m, inputs, gather_axis, indirect=False)
        take_over(m.concat.output(0), kv.output(0))
        log.debug("fuse-kvcache: fused %s", describe_node(m.concat))

    def _fuse_indirect(self, model: ov.Model, matches: list[Match], beam_idx: ov.Node) -> None:
        stateful = matches[0].store.get_type_name() == "Assign"
        if stateful:
            table_in = _beam_table_read(model, beam_idx, matches[0])
        else:
            param = ops.parameter([-1, -1], np.int32)
            set_name(param.output(0), BEAM_TABLE_INPUT)
            model.add_parameters([param])
            table_in = param.output(0)
        table_out = None
        for m in matches:
            axis = _gather_axis(m.gather)
            kv = self._kvcache(m, [m.past, m.new, beam_idx.output(0), table_in], axis, indirect=True)
            cache, table = kv.output(0), kv.output(1)
            concat_out = m.concat.output(0)
            names = concat_out.get_names()
            m.store_input.replace_source_output(cache)
            read = _indirect_read(cache, table, axis, int(m.concat.get_attributes()["axis"]),
                                  m.concat.get_friendly_name())
            for target in list(concat_out.get_target_inputs()):
                target.replace_source_output(read)
            concat_out.get_tensor().set_names(set())
            cache.get_tensor().set_names(names)
            table_out = table_out or table
            log.debug("fuse-kvcache: fused %s (indirect)", describe_node(m.concat))
        if stateful:
            # OpenVINO's Python Assign takes a node (its output 0): build it on the ReadValue,
            # then point it at the KVCache's beam-table output.
            assign = ops.assign(table_in.get_node(), model.get_variable_by_id(BEAM_TABLE_VARIABLE))
            assign.input(0).replace_source_output(table_out)
            model.add_sinks([assign])
        else:
            result = ops.result(table_out)
            set_name(result.output(0), BEAM_TABLE_OUTPUT)
            model.add_results([result])


def _gather_axis(gather: ov.Node) -> int:
    axis = int(gather.input_value(2).get_node().get_data().reshape(-1)[0])
    rank = gather.get_output_partial_shape(0).rank.get_length()
    return axis + rank if axis < 0 else axis


def take_over(old: ov.Output, new: ov.Output) -> None:
    """Route every consumer of `old` to `new`, and move its tensor names (model outputs keep theirs)."""
    names = old.get_names()
    for target in list(old.get_target_inputs()):
        target.replace_source_output(new)
    old.get_tensor().set_names(set())
    new.get_tensor().set_names(names)


def _beam_table_read(model: ov.Model, beam_idx: ov.Node, first: Match) -> ov.Output:
    """The shared beam-table variable. Its initial value is the identity table for whatever
    the cache already holds (`bt[b, s] = b`, length read from the first cache's past): right
    for an empty cache and for a cache a user set by hand, and not a constant, which OpenVINO
    CPU would otherwise fold into a fixed-size state."""
    info = VariableInfo()
    info.data_shape = ov.PartialShape([-1, -1])
    info.data_type = ov.Type.i32
    info.variable_id = BEAM_TABLE_VARIABLE
    var = Variable(info)
    model.add_variables([var])
    rank = first.past.get_partial_shape().rank.get_length()
    seq = int(first.concat.get_attributes()["axis"])
    seq = seq + rank if seq < 0 else seq
    init = fresh_rows(beam_idx.output(0), first.past, seq, ov.Type.i32)
    read = ops.read_value(init, var)
    read.set_friendly_name(BEAM_TABLE_VARIABLE)
    return read.output(0)


def fresh_rows(beam_idx: ov.Output, like: ov.Output, seq_axis: int, dtype: ov.Type) -> ov.Output:
    """[B, S] with row b filled with b, S the length of `like` along `seq_axis`: the beam table
    of rows that were written in place (this step's rows, or a cache with no reorder history)."""
    batch = ops.squeeze(ops.shape_of(beam_idx, output_type="i64"), ops.constant(np.array([0], np.int64)))
    rows = ops.range(ops.constant(np.int64(0)), batch, ops.constant(np.int64(1)), output_type=dtype)
    length = ops.gather(ops.shape_of(like, output_type="i64"), ops.constant(np.array([seq_axis], np.int64)),
                        ops.constant(np.int64(0)))
    shape = ops.concat([ops.unsqueeze(batch, ops.constant(np.array([0], np.int64))), length], 0)
    return ops.broadcast(ops.unsqueeze(rows, ops.constant(np.array([1], np.int64))), shape).output(0)


def _indirect_read(cache: ov.Output, table: ov.Output, batch_axis: int, seq_axis: int, base: str) -> ov.Output:
    """cache[bt[b, s], ..., s, ...]: the beam table broadcast over the other axes, then GatherElements."""
    rank = cache.get_partial_shape().rank.get_length()
    seq_axis = seq_axis + rank if seq_axis < 0 else seq_axis
    bt = table
    if seq_axis < batch_axis:
        bt = ops.transpose(bt, ops.constant(np.array([1, 0], np.int64))).output(0)
    others = [a for a in range(rank) if a not in (batch_axis, seq_axis)]
    idx = ops.unsqueeze(bt, ops.constant(np.array(others, np.int64))) if others else bt
    idx = ops.broadcast(idx, ops.shape_of(cache, output_type="i64"))
    read = ops.gather_elements(cache, idx, batch_axis)
    read.set_friendly_name(f"{base}/indirect_read")
    return read.output(0)
