"""lift-state: stateful to stateless by lambda lifting.

Every ReadValue/Assign pair becomes an input and an output, exactly as OpenVINO's
StatefulToStateless names and orders them (REFERENCE.md §2), so kvc's lifted model and
OpenVINO's are interchangeable:

* a variable id matching ``past_key_values.N.<k>present.M.<k'>`` gives input
  ``past_key_values.N.<k>`` and output ``present.M.<k'>``; any other id gives
  ``input_restored.<id>`` / ``output_restored.<id>``;
* new inputs and outputs are appended after the existing ones: ids with N == M first, by
  ``2N + (k == value)`` (numeric layer order, key before value), then the rest in sink order;
* input and output tensors carry exactly that one name (other names are dropped, as OpenVINO
  does), and the node gets it as its friendly name;
* the ReadValues' init subgraphs become dead and vanish; no variable or sink remains.

``beam=drop`` (OpenVINO's behaviour) removes the Gathers on ``beam_idx`` that reorder the
state and the ``beam_idx`` input itself; ``beam=keep`` (npu_compiler's) keeps them, the
Gather now reading the new input. Unlike OpenVINO's pass, a model without ``beam_idx`` (or
with variables that are never reordered) is accepted.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import ClassVar

import openvino as ov
import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult, describe_node, option
from kvc.passes.framework.registry import register_pass
from kvc.passes.framework.rules import NoMatch, Rule

log = logging.getLogger(__name__)

_NAMING = re.compile(r"(past_key_values\.(\d+)\.(key|value))(present\.(\d+)\.(key|value))")


@dataclass(frozen=True)
class LiftedName:
    variable_id: str
    input_name: str
    output_name: str
    index: int  # 2 * layer + is_value, or -1 when the id does not name its layer consistently


def lifted_name(variable_id: str) -> LiftedName:
    """OpenVINO's naming rule for the input and output that replace a variable."""
    m = _NAMING.fullmatch(variable_id)
    if not m:
        return LiftedName(variable_id, f"input_restored.{variable_id}", f"output_restored.{variable_id}", -1)
    index = int(m.group(2)) * 2 + (m.group(3) == "value") if m.group(2) == m.group(5) else -1
    return LiftedName(variable_id, m.group(1), m.group(4), index)


def set_name(output: ov.Output, name: str) -> None:
    """One tensor name and the matching friendly name, as ov::op::util::set_name does."""
    output.get_node().set_friendly_name(name)
    output.get_tensor().set_names({name})


def find_beam_idx(model: ov.Model) -> ov.Node | None:
    for p in model.get_parameters():
        if "beam_idx" in p.output(0).get_names():
            return p
    return None


def _beam_gather(beam_idx: ov.Node):
    """The rule's match: a Gather that reorders a state by beam_idx."""
    def match(node: ov.Node) -> ov.Node:
        if node.get_input_size() < 2 or node.input_value(1).get_node() != beam_idx:
            raise NoMatch(f"its indices come from {describe_node(node.input_value(1).get_node())}, not beam_idx")
        return node
    return match


@register_pass
@dataclass(frozen=True)
class LiftState(Pass):
    """Turn ReadValue/Assign pairs into inputs/outputs (stateful to stateless)."""

    name: ClassVar[str] = "lift-state"
    ensures: ClassVar[tuple[str, ...]] = ("stateless",)
    beam: str = option("drop", choices=("drop", "keep"),
                       help="drop: remove beam_idx and its Gathers (OpenVINO); keep: keep them (npu_compiler)")

    def run(self, model: ov.Model) -> PassResult:
        sinks = list(model.get_sinks())
        if not sinks and not model.get_variables():
            log.debug("lift-state: no variables, nothing to do")
            return PassResult(model, False)
        reads, assigns, sink_index = self._pair_variables(model, sinks)
        beam_idx = find_beam_idx(model)
        beam_gather = None
        if self.beam == "drop" and beam_idx is not None:
            beam_gather = Rule("lift-state/beam-gather", anchors=("Gather",), match=_beam_gather(beam_idx))
        names = sorted((lifted_name(v) for v in assigns),
                       key=lambda n: (n.index < 0, n.index if n.index >= 0 else sink_index[n.variable_id]))
        new_params, new_results = [], []
        for n in names:
            param, result = self._lift(model, n, reads[n.variable_id], assigns[n.variable_id], beam_gather)
            new_params.append(param)
            new_results.append(result)
        if beam_gather is not None:
            self._drop_beam_idx(model, beam_idx)
        model.add_parameters(new_params)
        model.add_results(new_results)
        model.validate_nodes_and_infer_types()
        return PassResult(model, True)

    def _pair_variables(self, model: ov.Model, sinks: list[ov.Node]):
        """Each variable's one ReadValue and one Assign (anything else is refused), and the
        Assigns' order among the sinks."""
        assigns: dict[str, ov.Node] = {}
        sink_index: dict[str, int] = {}
        for i, s in enumerate(sinks):
            if s.get_type_name() != "Assign":
                raise self.fail("only Assign sinks can be lifted", s)
            var_id = s.get_attributes()["variable_id"]
            if var_id in assigns:
                raise self.fail(f"variable {var_id} is assigned twice", s)
            assigns[var_id] = s
            sink_index[var_id] = i
        reads: dict[str, ov.Node] = {}
        for node in model.get_ordered_ops():
            if node.get_type_name() == "ReadValue":
                var_id = node.get_attributes()["variable_id"]
                if var_id in reads:
                    raise self.fail(f"variable {var_id} is read by two ReadValues", node)
                reads[var_id] = node
        for var_id, assign in assigns.items():
            if var_id not in reads:
                raise self.fail(f"variable {var_id} is assigned but never read", assign)
        for var_id, read in reads.items():
            if var_id not in assigns:
                raise self.fail(f"variable {var_id} is read but never assigned", read)
        return reads, assigns, sink_index

    @staticmethod
    def _lift(model: ov.Model, n: LiftedName, read: ov.Node, assign: ov.Node, beam_gather: Rule | None):
        """Replace one variable's ReadValue by an input and its Assign by an output."""
        source = read.output(0)
        if beam_gather is not None:
            for gather in beam_gather.matches([t.get_node() for t in source.get_target_inputs()]):
                # The new input replaces the reordered state, as OpenVINO's pass does.
                for consumer in list(gather.output(0).get_target_inputs()):
                    consumer.replace_source_output(source)
        param = ops.parameter(read.get_output_partial_shape(0), read.get_output_element_type(0))
        set_name(param.output(0), n.input_name)
        for consumer in list(source.get_target_inputs()):
            consumer.replace_source_output(param.output(0))
        result = ops.result(assign.input_value(0))
        set_name(result.output(0), n.output_name)
        model.remove_sink(assign)
        model.remove_variable(model.get_variable_by_id(n.variable_id))
        log.debug("lift-state: %s -> input %s, output %s", n.variable_id, n.input_name, n.output_name)
        return param, result

    def _drop_beam_idx(self, model: ov.Model, beam_idx: ov.Node) -> None:
        users = [t.get_node() for t in beam_idx.output(0).get_target_inputs() if _is_live(t.get_node())]
        if users:
            raise self.fail("beam_idx is used by more than the state-reordering Gathers; use beam=keep", users[0])
        model.remove_parameter(beam_idx)


def _is_live(node: ov.Node) -> bool:
    """A node something still consumes (the bypassed Gathers are dead)."""
    return any(o.get_target_inputs() for o in node.outputs())
