"""One CPU blob for two static models: the branches of an If, their weights packed once.

The CPU plugin packs a compiled model's weights into memory of its own (bf16 blocks where it
computes at bf16), and shares a packing only inside one compiled model: its weights cache
is per compiled model, keyed by the constant's address (intel_cpu weights_cache.hpp,
DnnlExtensionUtils::computeWeightsStringHash). Every static model compiled alone holds all the
weights again: the 250M Llama's four CPU models held 464 MB each.

A first-chunk model `first-F` and the prefill model of F rows (the bulk chunk `prefill-F`, or
the chunk `prefill` when C = F) give the same outputs and read the same weights; they differ
in their inputs (the first reads no past; its mask has F columns). So kvc compiles them for
the CPU as one model: an If whose then-body is the first model and else-body the other, both
read over one mapping of weights.bin so that their constants have the same addresses. The
If's input `kvc.select.<then model>` selects the then-body when true (`select_input`). The
plugin's If runs one body per inference and copies only that body's inputs into it
(nodes/if.cpp); a past of 896 rows costs a copy per 128-row call. On the 250M Llama
(AVX512_BF16 host): compiled together 1541 MB against 1947 for the two apart, and the same
time per call (first 140 ms, bulk 167; docs/benchmarks.md).

The If's inputs (`branch_inputs`): an input both models have with the same type and shape
keeps its names; any other is named `<model>.<name>` (`first-128.attention_mask`). Its
outputs are the models' outputs, which must be identical. A manifest records the pair as
`"branches": [then, else]` in both models' blob entries, which name the same file.

The generate model stays apart: it runs once a token and would copy its whole past per step.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import openvino as ov

from kvc.runtime.session import OpenVINOSession


def select_input(then: str) -> str:
    """The If's boolean input, named for the model it selects when true (its then-body): a
    manifest that swapped the pair's order would name another input, and be refused."""
    return f"kvc.select.{then}"


def branch_pairs(models: Mapping[str, dict], device: str) -> list[tuple[str, str]]:
    """The (first-F, prefill model of F rows) pairs whose blob is one If on `device` (the CPU
    only): `models` maps a name to its manifest entry (its `inputs` and `outputs` tables), and
    a pair's outputs must be identical."""
    from kvc.export.manifest import model_kind

    if device != "CPU":
        return []
    pairs = []
    for name, entry in models.items():
        kind, size = model_kind(name)
        if kind != "first":
            continue
        other = next((n for n, e in models.items() if model_kind(n)[0] == "prefill"
                      and _rows(e) == size and _ports(e["outputs"]) == _ports(entry["outputs"])), None)
        if other is not None:
            pairs.append((name, other))
    return pairs


def _rows(entry: dict) -> int | None:
    ids = next((p for p in entry["inputs"] if p["name"] == "input_ids"), None)
    return None if ids is None else ids["shape"][-1]


def _ports(table: list[dict]) -> list[tuple]:
    return [(p["name"], p["element_type"], tuple(p["shape"])) for p in table]


def branch_inputs(tables: Mapping[str, list[dict]]) -> dict[str, dict[str, str]]:
    """For each model (by name, its inputs table), its inputs' names in the If: an input every
    model has with the same type and shape keeps its name; any other becomes `<model>.<name>`."""
    shared = set.intersection(*(set(_ports(t)) for t in tables.values()))
    return {model: {p["name"]: p["name"] if (p["name"], p["element_type"], tuple(p["shape"])) in shared
                    else f"{model}.{p['name']}" for p in table}
            for model, table in tables.items()}


def branch_ports(entries: Mapping[str, dict]) -> dict:
    """The inputs and outputs tables of the If over the models' manifest `entries` (then,
    else): the selector, then each model's inputs as `branch_inputs` names them, in order."""
    names = branch_inputs({m: e["inputs"] for m, e in entries.items()})
    inputs = [{"name": select_input(next(iter(entries))), "element_type": "boolean", "shape": []}]
    for model, entry in entries.items():
        for port in entry["inputs"]:
            if names[model][port["name"]] not in [p["name"] for p in inputs]:
                inputs.append({**port, "name": names[model][port["name"]]})
    return {"inputs": inputs, "outputs": next(iter(entries.values()))["outputs"]}


def branch_model(models: Mapping[str, ov.Model]) -> ov.Model:
    """The If over two static models (then, else) with identical outputs. Their constants must
    share addresses (both read over one `map_weights` mapping) for the plugin to pack them once."""
    from kvc.export.manifest import port_table
    from openvino import opset8 as ops

    (then_name, then_model), (else_name, else_model) = models.items()
    names = branch_inputs({m: port_table(model.inputs) for m, model in models.items()})
    select = ops.parameter([], ov.Type.boolean, name=select_input(then_name))
    select.output(0).set_names({select_input(then_name)})
    node = ops.if_op(select.output(0))
    node.set_then_body(then_model)
    node.set_else_body(else_model)
    outer = {select_input(then_name): select}
    for model_name, model in models.items():
        for param in model.get_parameters():
            name = names[model_name][param.output(0).get_any_name()]
            if name not in outer:
                outer[name] = ops.parameter(param.get_partial_shape(), param.get_element_type(), name=name)
                outer[name].output(0).set_names({name})
            bodies = (param if model is then_model else None, param if model is else_model else None)
            node.set_input(outer[name].output(0), *bodies)
    results = []
    for then_result, else_result in zip(then_model.get_results(), else_model.get_results()):
        result = ops.result(node.set_output(then_result, else_result))
        result.output(0).set_names(set(then_result.output(0).get_names()))
        results.append(result)
    return ov.Model(results, list(outer.values()), f"{then_name}+{else_name}")


class BranchSession(OpenVINOSession):
    """One model of an If blob whose then-body is `then`: its inputs by its own names (`names`:
    its name -> the If's), the selector fed true for the then-body (`select`); the other body's
    inputs are left as the request holds them (the If does not read them)."""

    def __init__(self, compiled: ov.CompiledModel, device: str, names: Mapping[str, str], then: str, select: bool):
        super().__init__(compiled, device)
        self._names = dict(names)
        self._select = {select_input(then): np.array(select)}
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
