"""One CPU blob for several static models: the branches of a chain of Ifs, their weights packed once.

The CPU plugin packs a compiled model's weights into memory of its own (bf16 blocks where it
computes at bf16), and shares a packing only inside one compiled model: its weights cache
is per compiled model, keyed by the constant's address (intel_cpu weights_cache.hpp,
DnnlExtensionUtils::computeWeightsStringHash). Every static model compiled alone holds all the
weights again: the 250M Llama's four CPU models held 464 MB each.

The prefill models, the chunk `prefill`, the bulk chunks `prefill-B` and the first chunks
`first-F`, read the same weights and give outputs of the same names and types (their rows
differ); their inputs differ (a first chunk reads no past; its mask has F columns). So kvc
compiles them for the CPU as one model (`branch_chain` picks them): a chain of Ifs, each on a
boolean input `kvc.select.<place>.<model>` (`select_input`) whose then-body is that model and
else-body the next If, the last model the innermost else-body, every body read over one
mapping of weights.bin so that their constants have the same addresses. The plugin's If runs
one body per inference and copies that body's inputs into it at every level it is nested in
(nodes/if.cpp): the chunk, the most frequent call (a short prompt's only one), is the
outermost then-body (its 1008-row past copied once), the bulk chunks next (copied twice), the
first chunks, which read no past, last. The outputs are padded with zeros to the largest of
every body's (`padded_outputs`), so that the Ifs' outputs are static, and each
`BranchSession` cuts its own back. A first chunk of dynamic rows (`--prefill-first-rows
dynamic`) is a body too: its inputs are dynamic, its outputs padded to F rows at least
(`bounded`) by a Pad of what their ShapeOf lacks and a Reshape, which types them static; the
CPU plugin 2026.4.1 ran such a chain alternating bodies and row counts, and the chunk and bulk
bodies ran no slower beside it; it leads the chain (`branch_chain`), every prompt's first call.
On the 250M Llama (AVX512_BF16 host), the chunk, bulk and first chunk compiled as one held
1700 MB against 2539 for the three apart (one packing of the weights, not three); an open
holds 1125 MB against 1508 when only the first and bulk chunks shared a blob. The price is the bulk calls': a 1000-token prompt's TTFT (a first chunk, then
seven bulk calls) took 1489 ms against 1402, a 16- or 100-token prompt's the same
(docs/benchmarks.md).

The If's inputs (`branch_inputs`): an input every model has with the same type and shape keeps
its names; any other is named `<model>.<name>` (`first-128.attention_mask`). A manifest records
the group as `"branches"` (the chain's order) in each model's blob entry, which all name the
same file; `branch_selects` says what each model feeds the selectors.

The generate models stay apart: each runs once a token and would copy its whole past per step
(a generate step through an If with the chunk measured 10-20% slower here).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import openvino as ov

from kvc.runtime.session import OpenVINOSession


def select_input(order, model: str) -> str:
    """The boolean input of the If whose then-body is `model`, named for its place in the If's
    `order` and for the model: a manifest that reordered the branches would name other inputs,
    and be refused."""
    return f"kvc.select.{list(order).index(model)}.{model}"


def branch_groups(models: Mapping[str, dict], device: str) -> list[tuple[str, ...]]:
    """The models whose blob is one If chain on `device`, in its order (`branch_chain`).
    `models` maps a name to its manifest entry; a group's outputs must pad to one table
    (`padded_outputs`: those that differ from the first's are left out); a group of one is no
    group. A first chunk of dynamic rows (-1 in its inputs) leads the chain."""
    from kvc.export.manifest import model_kind, padded_outputs

    dynamic = any(-1 in p["shape"] for n, m in models.items() if (model_kind(n) or ("",))[0] == "first"
                  for p in m["inputs"])
    group = branch_chain(models, device, dynamic_first=dynamic)
    group = [n for n in group if padded_outputs([models[n]["outputs"], models[group[0]]["outputs"]]) is not None]
    return [tuple(group)] if len(group) > 1 else []


def branch_chain(names, device: str, dynamic_first: bool = False) -> tuple[str, ...]:
    """Which of the static models (by name) one If chain holds on `device` (the CPU only), in
    its order: every prefill model, the chunk first (the most frequent call, its past copied
    into one body, where a model nested deeper is copied at each level), then the bulk chunks
    and the first chunks (which read no past), each from the largest; a chain of one is none.
    A first chunk of dynamic rows (`dynamic_first`) goes first instead: it is every prompt's
    first call, and the chunk and bulk chunks serve only what follows its F tokens. Each level
    copies the running body's outputs out again (padded to the largest rows): the 250M Llama's
    16-token call took 84.9 ms outermost against 92.5 innermost, a chunk call 156 against 141,
    a bulk call 798 against 767 (`bench/if_chain.py`, one process). The rule kvc compile
    groups by, and `kvc plan` counts blobs by (kvc.planner)."""
    from kvc.export.manifest import model_kind

    if device != "CPU":
        return ()
    order = {"first": 0, "prefill": 1} if dynamic_first else {"prefill": 0, "first": 1}
    chain = sorted((n for n in names if model_kind(n)[0] in order),
                   key=lambda n: (order[model_kind(n)[0]], model_kind(n)[1] is not None, -(model_kind(n)[1] or 0)))
    return tuple(chain) if len(chain) > 1 else ()


def _ports(table: list[dict]) -> list[tuple]:
    return [(p["name"], p["element_type"], tuple(p["shape"])) for p in table]


def branch_inputs(tables: Mapping[str, list[dict]]) -> dict[str, dict[str, str]]:
    """For each model (by name, its inputs table), its inputs' names in the If: an input every
    model has with the same type and shape keeps its name; any other becomes `<model>.<name>`."""
    shared = set.intersection(*(set(_ports(t)) for t in tables.values()))
    return {model: {p["name"]: p["name"] if (p["name"], p["element_type"], tuple(p["shape"])) in shared
                    else f"{model}.{p['name']}" for p in table}
            for model, table in tables.items()}


def branch_selects(order) -> dict[str, dict[str, bool]]:
    """What each model of an If chain (in its order) feeds every selector: true for its own If,
    false for the others (the last model has no If of its own: it is the innermost else-body).
    Every selector is fed, so none is left to what a request happened to hold."""
    order = list(order)
    return {m: {select_input(order, o): o == m for o in order[:-1]} for m in order}


def branch_ports(entries: Mapping[str, dict]) -> dict:
    """The inputs and outputs tables of the If chain over the models' manifest `entries` (in
    its order): the selectors, then each model's inputs as `branch_inputs` names them; the
    outputs are every model's padded to the largest (`padded_outputs`)."""
    from kvc.export.manifest import padded_outputs

    names = branch_inputs({m: e["inputs"] for m, e in entries.items()})
    inputs = [{"name": select_input(entries, m), "element_type": "boolean", "shape": []} for m in list(entries)[:-1]]
    for model, entry in entries.items():
        for port in entry["inputs"]:
            if names[model][port["name"]] not in [p["name"] for p in inputs]:
                inputs.append({**port, "name": names[model][port["name"]]})
    return {"inputs": inputs, "outputs": padded_outputs([bounded(m, e["outputs"]) for m, e in entries.items()])}


def bounded(name: str, table: list[dict]) -> list[dict]:
    """A port table with each dynamic dimension (-1) at its largest: the F rows of the first
    chunk `name` ("first-F") of dynamic rows, which the If's outputs must hold."""
    from kvc.export.manifest import model_kind

    rows = model_kind(name)[1]
    return [{**p, "shape": [rows if d < 0 else d for d in p["shape"]]} for p in table]


def branch_model(models: Mapping[str, ov.Model]) -> ov.Model:
    """The If chain over static models (in order: each model the then-body of one If whose
    else-body holds the rest; the last the innermost else-body). Each body's outputs are padded
    with zeros to the largest of every model's, so that the If's outputs are static: OpenVINO
    2026.4.1's CPU plugin crashed running an If whose outputs were dynamic (a segfault when a
    body of fewer rows ran before one of more). The constants must share addresses (all read
    over one `map_weights` mapping) for the plugin to pack them once."""
    from kvc.export.manifest import padded_outputs, port_table

    names = branch_inputs({m: port_table(model.inputs) for m, model in models.items()})
    order = list(models)
    tables = [bounded(m, port_table(model.outputs)) for m, model in models.items()]
    largest = [p["shape"] for p in padded_outputs(tables)]
    for name, model in models.items():  # every body's parameters by their names in the If
        for param in model.get_parameters():
            param.output(0).set_names({names[name][param.output(0).get_any_name()]})
        _pad_results(model, largest)
    inner = models[order[-1]]
    for name in reversed(order[:-1]):
        inner = _if(select_input(order, name), models[name], inner)
    return inner


def _pad_results(model: ov.Model, shapes) -> None:
    """Pad each result of `model` with zeros at the end of every axis up to `shapes`. A result
    with a dynamic axis (a first chunk of dynamic rows) is padded by what its ShapeOf lacks of
    `shapes`, then reshaped to them, which OpenVINO types static: the If's outputs stay static,
    and no constant of padding is folded into the blob."""
    from openvino import opset8 as ops

    for result, shape in zip(model.get_results(), shapes):
        have = result.get_output_partial_shape(0)
        if have.is_static and list(have.to_shape()) == list(shape):
            continue
        value = result.input_value(0)
        zero = ops.convert(ops.constant(np.zeros((), np.float32)), value.get_element_type())  # bf16 too
        begins = ops.constant(np.zeros(len(shape), np.int64))
        if have.is_static:
            ends = np.array(shape, np.int64) - np.array(list(have.to_shape()), np.int64)
            padded = ops.pad(value, begins, ops.constant(ends), "constant", zero)
        else:
            target = ops.constant(np.array(shape, np.int64))
            padded = ops.reshape(ops.pad(value, begins, ops.subtract(target, ops.shape_of(value, "i64")), "constant",
                                         zero), target, False)
        result.input(0).replace_source_output(padded.output(0))
    model.validate_nodes_and_infer_types()


def _if(selector: str, then_model: ov.Model, else_model: ov.Model) -> ov.Model:
    """One If: the boolean input `selector` picks `then_model`, else `else_model`; each body's
    parameters matched to the If's inputs by name, each body's results (in order) to its
    outputs. The port descriptions are set whole and the If validated once: `If.set_input` and
    `set_output` validate the node at every call, both bodies and every If nested in them,
    which took 1.7 of the 2.4 s the bench model's three-body chain took to build."""
    from openvino import opset8 as ops
    from openvino.op.util import BodyOutputDescription, InvariantInputDescription

    select = ops.parameter([], ov.Type.boolean, name=selector)
    select.output(0).set_names({selector})
    node = ops.if_op(select.output(0))
    node.set_then_body(then_model)
    node.set_else_body(else_model)
    params = [then_model.get_parameters(), else_model.get_parameters()]
    indices = [{p.output(0).get_any_name(): i for i, p in enumerate(ps)} for ps in params]
    outer = {selector: select}
    described: tuple[list, list] = ([], [])
    for name in dict.fromkeys([*indices[0], *indices[1]]):
        body = 0 if name in indices[0] else 1
        param = params[body][indices[body][name]]
        outer[name] = ops.parameter(param.get_partial_shape(), param.get_element_type(), name=name)
        outer[name].output(0).set_names({name})
        for b in (0, 1):
            if name in indices[b]:
                described[b].append(InvariantInputDescription(len(outer) - 1, indices[b][name]))
    node.set_arguments([p.output(0) for p in outer.values()])
    count = len(then_model.get_results())
    if len(else_model.get_results()) != count:
        raise ValueError(f"an If's bodies have {count} and {len(else_model.get_results())} results")
    for b in (0, 1):
        node.set_input_descriptions(b, described[b])
        node.set_output_descriptions(b, [BodyOutputDescription(i, i) for i in range(count)])
    node.set_output_size(count)
    node.validate_and_infer_types()
    results = []
    for i, then_result in enumerate(then_model.get_results()):
        result = ops.result(node.output(i))
        result.output(0).set_names(set(then_result.output(0).get_names()))
        results.append(result)
    return ov.Model(results, list(outer.values()), f"{then_model.get_friendly_name()}+{else_model.get_friendly_name()}")


class BranchSession(OpenVINOSession):
    """One model of an If blob: its inputs by its own names (`names`: its name -> the If's),
    the selectors fed as `selects` says (`branch_selects`), its outputs cut back to its own
    `shapes` (by name; the If pads them; a dynamic dimension, -1, is left whole: the caller
    takes the rows it fed); the other bodies' inputs are left as the request
    holds them (the Ifs do not read them)."""

    def __init__(self, compiled: ov.CompiledModel, device: str, names: Mapping[str, str],
                 selects: Mapping[str, bool], shapes: Mapping[str, list[int]]):
        super().__init__(compiled, device)
        self._names = dict(names)
        self._select = {name: np.array(value) for name, value in selects.items()}
        cut = {name: tuple(slice(0, d if d >= 0 else None) for d in shape) for name, shape in shapes.items()}
        self._cuts = [next(cut[n] for n in names if n in cut) for names in self._outputs]
        mine = set(self._names.values()) | set(self._select)
        self._skipped = {i for i, (names, _) in enumerate(self._inputs) if not mine & set(names)}

    @property
    def input_names(self) -> list[str]:
        return list(self._names)

    def has_input(self, name: str) -> bool:
        return name in self._names

    def input_dtype(self, name: str) -> np.dtype:
        return super().input_dtype(self._names[name])

    def bind(self, name: str, buffer: np.ndarray, rows: int, axis: int) -> None:
        super().bind(self._names[name], buffer, rows, axis)

    def infer(self, inputs):
        return super().infer({**{self._names.get(k, k): v for k, v in inputs.items()}, **self._select})
