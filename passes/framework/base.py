"""What every pass is: a small frozen dataclass whose fields are its options.

    @register_pass
    @dataclass(frozen=True)
    class LiftState(Pass):
        name: ClassVar[str] = "lift-state"
        beam: str = option("drop", choices=("drop", "keep"), help="...")

        def run(self, model: ov.Model) -> PassResult: ...

A pass rewrites the model in place (OpenVINO's own convention) and says whether it modified
it: `PassResult.modified` is true exactly when the model's text changed (the PassManager's
check mode holds every pass to it). A pass names the invariants it `requires` of its input
and `ensures` of its output (`kvc.passes.framework.invariants`); the PassManager checks them
around every run. Pattern matching inside a pass is written as named rewrite rules
(`kvc.passes.framework.rules`), whose hits and misses the PassManager reports.

A pass that cannot apply raises `PassFailure` naming itself, the node (type, friendly name,
tensor names) and why; the PassManager adds the passes that ran before.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import openvino as ov

from kvc.errors import PassError
from kvc.ir.naming import is_counter_name


@dataclass(frozen=True)
class PassResult:
    model: ov.Model
    modified: bool


def reinfer(nodes: list[ov.Node]) -> None:
    """Infer again the element types and shapes of `nodes` (those a pass rewired), and of every
    node downstream whose inputs changed in consequence: what `validate_nodes_and_infer_types`
    does after a local edit, without a walk over the whole graph (7 ms per 2000-node model,
    once per pass and static model)."""
    work = deque(nodes)
    while work:
        node = work.popleft()
        before = type_signature(node)
        node.validate_and_infer_types()
        if type_signature(node) != before:
            for out in node.outputs():
                work.extend(target.get_node() for target in out.get_target_inputs())


def name_new(out: ov.Node, base: str, keep: set[ov.Node]) -> None:
    """Name the nodes a rewrite built to compute `out` `base/Type`, `base/Type.2`, ...:
    readable, stable across runs, and nothing left for `canonicalize_friendly_names` to hash.
    The nodes built are those above `out` that still have OpenVINO's counter names
    (``Multiply_1234``), short of `keep` (the nodes the rewrite consumes): the walk stops at a
    node already named, so a rewrite that reads a value computed far upstream (the new key
    rows, through every earlier layer) does not rename the weights and ops that computed it."""
    stack, seen, counts = [out], set(keep), {}
    while stack:
        for value in stack.pop().input_values():
            src = value.get_node()
            if src in seen or not is_counter_name(src.get_friendly_name()):
                continue
            seen.add(src)
            kind = src.get_type_name()
            counts[kind] = counts.get(kind, 0) + 1
            src.set_friendly_name(f"{base}/{kind}" + (f".{counts[kind]}" if counts[kind] > 1 else ""))
            stack.append(src)


def type_signature(node: ov.Node) -> list[tuple[str, str]]:
    return [(out.get_element_type().get_type_name(), str(out.get_partial_shape())) for out in node.outputs()]


def constant_ints(out: ov.Output) -> list[int] | None:
    """The values of a Constant as Python ints (flattened); None when `out` is not a Constant."""
    node = out.get_node()
    if node.get_type_name() != "Constant":
        return None
    return [int(v) for v in np.asarray(node.get_data()).reshape(-1)]


def option(default: Any, *, help: str, choices: tuple | None = None) -> Any:
    """A pass option: a dataclass field with its help text and allowed values."""
    return field(default=default, metadata={"help": help, "choices": choices})


def describe_node(node: ov.Node) -> str:
    """`Type 'friendly name' (tensors a, b)`: how errors and logs point at a node."""
    names = sorted({n for o in node.outputs() for n in o.get_names()})
    text = f"{node.get_type_name()} '{node.get_friendly_name()}'"
    return text + (f" (tensors {', '.join(names)})" if names else "")


class PassFailure(PassError):
    """A pass cannot apply to this model."""

    def __init__(self, pass_name: str, reason: str, node: ov.Node | None = None):
        self.pass_name = pass_name
        self.node = describe_node(node) if node is not None else None
        self.reason = reason
        self.file: str | None = None  # the model file, named by whoever loaded it (compile, bisect)
        self.context: list[str] = []  # lines the PassManager adds (passes before, dump path)
        super().__init__(self._message())

    def _message(self) -> str:
        where = f" at {self.node}" if self.node else ""
        source = f"{self.file}: " if self.file else ""
        return "\n".join([f"{source}pass {self.pass_name} failed{where}: {self.reason}", *self.context])

    def add_context(self, line: str) -> None:
        self.context.append(line)
        self.args = (self._message(),)

    def in_file(self, file) -> PassFailure:
        """Name the model file the failing model was read from; returns self, to re-raise."""
        self.file = str(file)
        self.args = (self._message(),)
        return self

    def __str__(self) -> str:
        return self._message()


@dataclass(frozen=True)
class Pass:
    """Base of every pass; subclasses set `name` and implement `run`."""

    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()  # invariants of the input (kvc.passes.framework.invariants)
    ensures: ClassVar[tuple[str, ...]] = ()  # invariants of the output

    def run(self, model: ov.Model) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def fail(self, reason: str, node: ov.Node | None = None) -> PassFailure:
        return PassFailure(self.name, reason, node)

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def spec(self) -> str:
        """The pass as pipeline text; options equal to their default are left out."""
        changed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default}
        if not changed:
            return self.name
        return self.name + "{" + ",".join(f"{k}={_format_option(v)}" for k, v in changed.items()) + "}"


def _format_option(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)):
        return ":".join(str(x) for x in v)
    return str(v)
