"""kvc's numpy interpreter for `ov.Model`: the reference that defines what a model computes.

A model is *prepared* once: every op gets its kernel from the op table, values get integer
slots, constants are bound to their (memory-mapped) data, constant subgraphs are folded,
and each value is scheduled to be freed after its last use. Running is then a flat loop
over steps, with no per-call graph analysis. OpenVINO reads the graph; it never computes a
value here (once per process, a tiny compile asks whether this host's CPU plugin rounds a
model's own bf16 values at all: `cpu_rounds_bf16`).

State follows OpenVINO's semantics: a ReadValue returns its variable's value, or evaluates
its init input when the variable is empty; Assigns take effect when the call finishes.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace
from typing import Callable, Collection, Iterable, Mapping

import numpy as np
import openvino as ov

from kvc.errors import KvcError
from kvc.ir.naming import best_tensor_name, name_model
from kvc.runtime.ops import load_all
from kvc.runtime.ops.registry import lookup, spec_of, to_dtype
from kvc.runtime.ops.lowbit import constant_array
from kvc.runtime.ops.movement import round_to_bf16

# Ops the interpreter itself implements (they touch inputs, outputs or state).
_BUILTIN = {"Parameter", "Result", "Constant", "ReadValue", "Assign"}
_STATEFUL = {"ReadValue", "Assign"}
# Weight decompression (NNCF's weights, as OpenVINO's MarkDequantization matches it): a
# low-bit Constant -> Convert -> [Subtract zero point] -> Multiply scale -> [Reshape ...] ->
# Convert to f32 (cb4: a Gather of its codebook by the codes; mxfp4, nvfp4: scales of their own
# types). NNCF computes it in f16 (f16 scales), but OpenVINO's plugins fuse it into the
# MatMul/Gather and dequantize in f32 (the CPU plugin at f32 inference precision does not round
# to f16 in between), so kvc computes such a subgraph in f32 too. Two Converts to f16 in it do
# round, as OpenVINO CPU 2026.4 rounds them (the compressed fixtures' goldens,
# tests/runtime/test_goldens.py, fail without either; so does cb4's without the Gather): one of
# an f32 value (nvfp4's f8e4m3 scale times its f32 scale), and the codes of nf4 (values no f16
# holds exactly) unless the weights feed only MatMuls, whose kernels read nf4's table at f32
# (an embedding's Gather, and a tied embedding's Gather and MatMul both, take the codes at f16).
# NPUW on its CPU backend rounds neither: NPU blobs are judged against the IR computed so (`npuw`).
_DECOMPRESSION_OPS = {"Convert", "Subtract", "Multiply", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Gather"}
_LOW_BIT = {"u8", "i8", "u6", "u4", "i4", "u3", "u2", "u1", "nf4", "f4e2m1", "f8e4m3", "f8e5m2", "f8e8m0"}
_F16, _F32, _I8 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.int8)


def decompression_nodes(model: ov.Model) -> tuple[set, set]:
    """The f16 nodes of weight-decompression subgraphs that end in a Convert to f32: each is
    constant-only, made of `_DECOMPRESSION_OPS`, starts from a low-bit Constant, and used only
    inside the subgraph (so no f16 value computed in f32 escapes it); and the Converts among
    them that round to f16 all the same (the comment above)."""
    found, rounded = set(), set()
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Convert" or op.get_output_element_type(0).get_type_name() != "f32" \
                or op.get_input_element_type(0).get_type_name() != "f16":
            continue
        inner, stack, low_bit, ok = set(), [op.input_value(0).get_node()], False, True
        while stack and ok:
            node = stack.pop()
            if node in inner:
                continue
            tname = node.get_type_name()
            if tname == "Constant":
                low_bit |= node.get_output_element_type(0).get_type_name() in _LOW_BIT
                continue
            if tname not in _DECOMPRESSION_OPS:
                ok = False
                break
            inner.add(node)
            stack.extend(i.get_source_output().get_node() for i in node.inputs())
        if not ok or not low_bit:
            continue
        users = {t.get_node() for n in inner for o in n.outputs() for t in o.get_target_inputs()}
        if users <= inner | {op}:
            halves = {n for n in inner if n.get_output_element_type(0).get_type_name() == "f16"}
            found |= halves
            rounded |= {n for n in halves if n.get_type_name() == "Convert" and n.get_input_element_type(0) == ov.Type.f32}
            if not all(t.get_node().get_type_name() == "MatMul" for t in op.output(0).get_target_inputs()):
                rounded |= {n for n in halves if n.get_type_name() == "Convert"
                            and n.get_input_element_type(0) == ov.Type.nf4}
    return found, rounded


def _f16_rounded(x):
    """A Convert to f16 inside a decompression subgraph kvc computes in f32: the f16 value, held as f32."""
    return x.astype(np.float16).astype(np.float32)


def _in_f32(spec, bf16: bool = False):
    """`spec` with f16 inputs and outputs read as f32 (and bf16 ones, which kvc holds as f32
    rounded to bf16, left unrounded, with `bf16`)."""
    wide = ("f16", "bf16") if bf16 else ("f16",)
    return replace(spec, input_types=tuple(_F32 if t == _F16 else t for t in spec.input_types),
                   output_types=tuple(_F32 if t == _F16 else t for t in spec.output_types),
                   output_etypes=tuple("f32" if t in wide else t for t in spec.output_etypes))


_HALF = {"f16", "bf16"}


def kv_boundary_nodes(model: ov.Model) -> set:
    """The nodes a widened interpreter computes at f32: those that read or write an f16 or
    bf16 value connected by f16 and bf16 values alone to an input or an output (kv-io's
    conversions at a static model's KV boundary: a past input, its Transpose and its Convert
    to f32; the Convert to f16 or bf16 before a present output; an int8 cache's f16 scales).
    The model's own reduced arithmetic is not widened: Falcon's ALiBi takes its positions at
    bf16 (transformers' `slopes.bfloat16() x positions`), which OpenVINO CPU at f32 rounds as
    the source does, and unrounded they are another function past 256 positions."""
    def half(port) -> bool:
        return port.get_element_type().get_type_name() in _HALF

    found: set = set()
    stack = [p.output(0) for p in model.get_parameters() if half(p.output(0))]
    stack += [r.input_value(0) for r in model.get_results() if half(r.input_value(0))]
    seen: set = set()
    while stack:
        port = stack.pop()
        key = (port.get_node(), port.get_index())
        if key in seen:
            continue
        seen.add(key)
        node = port.get_node()
        if node.get_type_name() not in ("Parameter", "Constant"):
            found.add(node)
            stack += [i.get_source_output() for i in node.inputs() if half(i.get_source_output())]
        for target in port.get_target_inputs():
            user = target.get_node()
            if user.get_type_name() == "Result":
                continue
            found.add(user)
            stack += [o for o in user.outputs() if half(o)]
    return found


@functools.cache
def cpu_rounds_bf16() -> bool:
    """Whether OpenVINO CPU at f32 rounds a model's own values to bf16 where the model converts
    them (Falcon's ALiBi positions, `slopes.bfloat16() x positions`). A host with bf16 rounds
    them (an integer as OpenVINO's bfloat16 does, `openvino_bf16`); one without (AVX2: the plugin's
    ConvertPrecision makes bf16 f32) computes them unrounded, and so does kvc's interpreter
    there: what it proves is what OpenVINO computes for the IR, which its checks compare with
    OpenVINO CPU's run of the source (tests/runtime/test_bf16.py, ONEDNN_MAX_CPU_ISA=AVX2). The
    cache's own conversions (`kv_boundary_nodes`) round on every host. One tiny compile, once."""
    import openvino.opset13 as ops

    from kvc.ir.reader import core

    x = ops.parameter([-1], ov.Type.f32)
    model = ov.Model([ops.convert(ops.convert(x, ov.Type.bf16), ov.Type.f32)], [x])
    got = core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(np.array([515.0], np.float32))[0]
    return float(got[0]) != 515.0


def _own_bf16(model: ov.Model, boundary: set) -> set:
    """The nodes that compute the model's own bf16 values (not the cache's), which a host whose
    CPU computes bf16 as f32 leaves unrounded (`cpu_rounds_bf16`). A value computed from
    constants alone is not one of them: OpenVINO folds it when it compiles, at its declared
    type, so rounded (on an AVX2 host Falcon's slopes `Convert(Constant, bf16)` are rounded,
    its positions and their product with the slopes are not)."""
    own = set()
    constant = set()  # computed from constants alone
    for n in model.get_ordered_ops():
        kind = n.get_type_name()
        if kind == "Constant" or (kind not in _BUILTIN and n.get_input_size()
                                  and all(i.get_source_output().get_node() in constant for i in n.inputs())):
            constant.add(n)
        elif n not in boundary and kind not in _BUILTIN and any(
                n.get_output_element_type(i) == ov.Type.bf16 for i in range(n.get_output_size())):
            own.add(n)
    return own if own and not cpu_rounds_bf16() else set()


def _bf16_arithmetic(kernel: Callable, etypes: tuple[str, ...]) -> Callable:
    """`kernel`, its bf16 outputs rounded as OpenVINO CPU rounds bf16 arithmetic (IEEE's
    nearest even: `round_to_bf16`): kvc computes bf16 at f32, and an op that OpenVINO
    computes at bf16 rounds its result (Falcon's ALiBi, `slopes.bfloat16() x positions`: with
    32 heads the slopes are 2^(-k/4), and unrounded the bias differs by up to 2 at position
    1000; the falcon_alibi fixture rebuilt with 32 heads was refused by every compile, 0.0038
    on a 7-token prompt)."""
    if len(etypes) == 1:
        return lambda *args: round_to_bf16(kernel(*args))

    def rounded(*args):
        return tuple(round_to_bf16(o) if t == "bf16" else o for o, t in zip(kernel(*args), etypes))
    return rounded


def input_dtype(port: ov.Output, widen: bool = False) -> np.dtype:
    """The array type an input port takes on kvc's interpreter: its element type's (`to_dtype`),
    f32 for f16 and i8 ones when the interpreter `widen`s (an int8 KV cache's inputs are its
    only i8 ports)."""
    want = to_dtype(port.get_element_type())
    return _F32 if widen and want in (_F16, _I8) else want


def int8_quantizers(model: ov.Model) -> set:
    """The nodes that round an int8 KV cache's outputs (kv-io: Round, Clamp to +-127 and the
    Convert to i8 before each i8 Result), which a widened interpreter passes through."""
    found = set()
    for result in model.get_results():
        node = result.input_value(0).get_node()
        if node.get_type_name() != "Convert" or node.get_output_element_type(0) != ov.Type.i8:
            continue
        found.add(node)
        node = node.input_value(0).get_node()
        if node.get_type_name() == "Clamp":
            found.add(node)
            node = node.input_value(0).get_node()
        if node.get_type_name() == "Round":
            found.add(node)
    return found


def _unrounded(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32)


# Folding a constant subgraph whose result is larger than this would copy weights for
# nothing (e.g. a Broadcast of a scalar); above it, the op runs at inference time.
_FOLD_LIMIT_BYTES = 64 << 20


class UnsupportedOpError(KvcError):
    """The model uses ops kvc's interpreter does not implement (all of them are listed)."""

    exit_code = 3


class EvaluationError(KvcError):
    """An op failed while executing; the message names the op and its inputs."""


class InputError(KvcError):
    """Inputs given to a session do not match the model's inputs."""

    exit_code = 2


def describe_array(a) -> str:
    """`dtype:shape [min, max]`, the interpreter's one-line summary of a value."""
    a = np.asarray(a)
    shape = "x".join(map(str, a.shape)) or "scalar"
    if a.size == 0 or a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.number):
        return f"{a.dtype}:{shape}"
    return f"{a.dtype}:{shape} [{a.min()}, {a.max()}]"


@dataclass(frozen=True)
class _Step:
    kernel: Callable
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    free: tuple[int, ...]
    node: ov.Node
    label: str  # "<Type> <friendly name>"


class TensorMap(Mapping):
    """Model outputs by tensor name: iterates primary names, looks up any alias."""

    def __init__(self, entries: Iterable[tuple[tuple[str, ...], np.ndarray]]):
        self._primary: dict[str, np.ndarray] = {}
        self._alias: dict[str, str] = {}
        for names, value in entries:
            self._primary[names[0]] = value
            for n in names:
                self._alias.setdefault(n, names[0])

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._primary[self._alias[name]]
        except KeyError:
            raise KeyError(f"no output named {name!r}; outputs: {', '.join(self._primary)}") from None

    def __iter__(self):
        return iter(self._primary)

    def __len__(self) -> int:
        return len(self._primary)

    def __contains__(self, name) -> bool:
        return name in self._alias


def port_names(port, source=None) -> tuple[str, ...]:
    """A port's tensor names, the primary one first: the source model port's name when given
    (compiled ports gain internal names), else the most readable (`best_tensor_name`)."""
    names = set(port.get_names())
    if not names:
        return (f"<output {port.get_index()}>",)
    preferred = source.get_names() & names if source is not None else set()
    first = best_tensor_name(preferred or names)
    return (first, *sorted(n for n in names if n != first))


class Interpreter:
    """A prepared model; `run` evaluates it, `state` holds its variables between runs."""

    def __init__(self, model: ov.Model, *, fold_constants: bool = True, widen: bool = False, npuw: bool = False):
        """`widen`: compute the f16 and bf16 values of the KV boundary at f32, unrounded
        (`kv_boundary_nodes`), inputs included, and an int8 cache's values unrounded too
        (`int8_quantizers` pass their input through as f32; its i8 inputs take f32, which the
        dequantization reads back exactly): the exact
        twin of a static model whose KV cache is stored at f16, bf16 or int8 (kv-io's
        conversions at its boundary round nothing), which the compile's check runs against
        the source at f32 with the exact rules (kvc.verify.compiled.ir_generations).
        `npuw`: weight decompression computed as NPUW on its CPU backend computes it, without
        the two roundings to f16 the CPU plugin makes (`decompression_nodes`: nf4's codes read
        by a Gather, nvfp4's f32 scale): the reference of NPU blobs (`npuw_reference`)."""
        load_all()
        check_supported(model)
        self.model = model
        self.widen = widen
        self.npuw = npuw
        self.state: dict[str, np.ndarray] = {}
        self._variables = {v.get_info().variable_id: v.get_info() for v in model.get_variables()}
        self._prepare(fold_constants)

    # -- preparation -------------------------------------------------------------------
    def _prepare(self, fold: bool) -> None:
        ops = self.model.get_ordered_ops()
        slot: dict[tuple[ov.Node, int], int] = {}
        consts: dict[int, np.ndarray] = {}
        steps: list[tuple[Callable, tuple[int, ...], tuple[int, ...], ov.Node]] = []
        self._inputs: list[tuple[tuple[str, ...], int, ov.Output]] = []
        self._results: list[tuple[tuple[str, ...], int]] = []

        def new_slots(node: ov.Node) -> tuple[int, ...]:
            out = []
            for port in range(node.get_output_size()):
                slot[(node, port)] = len(slot)
                out.append(slot[(node, port)])
            return tuple(out)

        in_f32, rounded = decompression_nodes(self.model)
        rounded = set() if self.npuw else rounded
        unrounded = int8_quantizers(self.model) if self.widen else set()
        boundary = kv_boundary_nodes(self.model)
        wide = (boundary if self.widen else set()) | _own_bf16(self.model, boundary)
        for node in ops:
            tname = node.get_type_name()
            ins = tuple(slot[(i.get_source_output().get_node(), i.get_source_output().get_index())]
                        for i in node.inputs())
            if tname == "Parameter":
                (s,) = new_slots(node)
                self._inputs.append((port_names(node.output(0)), s, node.output(0)))
            elif tname == "Constant":
                (s,) = new_slots(node)
                consts[s] = constant_array(node)
            elif tname == "Result":
                self._results.append((port_names(node.output(0)), ins[0]))
            elif tname == "ReadValue":
                outs = new_slots(node)
                steps.append((self._read_value(node), ins, outs, node))
            elif tname == "Assign":
                new_slots(node)
                steps.append((self._assign(node), ins, (), node))
            elif node in unrounded:
                steps.append((_unrounded, ins, new_slots(node), node))
            else:
                spec = spec_of(node)
                if node in wide or node in in_f32:
                    spec = _in_f32(spec, bf16=node in wide)
                kernel = _f16_rounded if node in rounded else lookup(tname, node.get_type_info().version_id)(spec)
                if tname != "Convert" and "bf16" in spec.output_etypes:  # not widened (`_in_f32`)
                    kernel = _bf16_arithmetic(kernel, spec.output_etypes)
                outs = new_slots(node)
                if fold and ins and all(i in consts for i in ins):
                    folded = self._try_fold(kernel, [consts[i] for i in ins], node)
                    if folded is not None:
                        consts.update(zip(outs, folded))
                        continue
                steps.append((kernel, ins, outs, node))

        self._slots = slot
        self._n_slots = len(slot)
        self._consts = consts
        frees = _frees(steps, keep={s for _, s in self._results} | set(consts))
        self._steps = [
            _Step(k, ins, outs, frees[i], n, f"{n.get_type_name()} {n.get_friendly_name()}")
            for i, (k, ins, outs, n) in enumerate(steps)
        ]

    @functools.cached_property
    def _slot_names(self) -> dict[int, str]:
        """Each value's stable name (kvc.ir.naming), for `trace` and `capture`: named when
        first asked for, as a plain run needs none (0.12 s of a numpy open of the bench model's
        five models)."""
        naming = name_model(self.model)
        return {s: naming.value(node.output(port)) for (node, port), s in self._slots.items()
                if (node, port) in naming._values}

    @staticmethod
    def _try_fold(kernel, args, node) -> tuple[np.ndarray, ...] | None:
        try:
            with np.errstate(all="ignore"):
                out = kernel(*args)
        except Exception as exc:  # report it where a user would see it: at run time, with context
            raise EvaluationError(_failure(f"{node.get_type_name()} {node.get_friendly_name()}",
                                           args, exc)) from exc
        outs = out if isinstance(out, tuple) else (out,)
        if sum(np.asarray(o).nbytes for o in outs) > _FOLD_LIMIT_BYTES:
            return None
        return tuple(np.asarray(o) for o in outs)

    def _read_value(self, node: ov.Node):
        var_id = node.get_attributes()["variable_id"]
        info = self._variables[var_id]
        dtype = to_dtype(info.data_type)

        def read(*init):
            value = self.state.get(var_id)
            if value is not None:
                return value
            if init:
                return np.asarray(init[0], dtype=dtype)
            shape = info.data_shape
            if shape.is_dynamic:
                raise EvaluationError(f"variable {var_id} is empty and has neither an init value nor a static "
                                      f"shape ({shape})")
            return np.zeros(shape.to_shape(), dtype=dtype)

        return read

    def _assign(self, node: ov.Node):
        var_id = node.get_attributes()["variable_id"]

        def assign(value):
            self._pending[var_id] = value

        return assign

    # -- running -----------------------------------------------------------------------
    def input_names(self) -> list[str]:
        return [names[0] for names, _, _ in self._inputs]

    def run(self, inputs: Mapping[str, np.ndarray], *, trace: bool | Callable[[str], None] = False,
            capture: bool | Collection[str] = False) -> TensorMap | tuple[TensorMap, dict[str, np.ndarray]]:
        """Evaluate the model. With `capture`, also return every value by its stable name (with
        a collection of names, only those values, the others freed as without it)."""
        env: list = [None] * self._n_slots
        for s, v in self._consts.items():
            env[s] = v
        for names, s, port in self._inputs:
            env[s] = bind_input(names, port, inputs, self.widen)
        unknown = set(inputs) - {n for names, _, _ in self._inputs for n in names}
        if unknown:
            raise InputError(f"unknown input(s) {', '.join(sorted(unknown))}; the model takes "
                             f"{', '.join(self.input_names())}")
        emit = (trace if callable(trace) else lambda line: print(line, file=sys.stderr)) if trace else None
        captured: dict[str, np.ndarray] = {}
        wanted = None if capture is True or capture is False else set(capture)
        capture = capture is not False
        if capture:
            captured.update({self._slot_names[s]: env[s] for _, s, _ in self._inputs
                             if s in self._slot_names and (wanted is None or self._slot_names[s] in wanted)})
        self._pending: dict[str, np.ndarray] = {}
        with np.errstate(all="ignore"):
            for step in self._steps:
                args = [env[i] for i in step.inputs]
                try:
                    out = step.kernel(*args)
                except KvcError:
                    raise
                except Exception as exc:
                    raise EvaluationError(_failure(step.label, args, exc)) from exc
                if len(step.outputs) == 1:
                    env[step.outputs[0]] = out
                elif step.outputs:
                    for s, v in zip(step.outputs, out):
                        env[s] = v
                if emit is not None:
                    for s in step.outputs:
                        emit(f"{self._slot_names.get(s, s)} = {step.node.get_type_name()}: "
                             f"{describe_array(env[s])}")
                if capture:
                    for s in step.outputs:
                        if s in self._slot_names and (wanted is None or self._slot_names[s] in wanted):
                            captured[self._slot_names[s]] = env[s]
                if wanted is not None or not capture:
                    for s in step.free:
                        env[s] = None
        self.state.update(self._pending)
        outputs = TensorMap((names, np.asarray(env[s])) for names, s in self._results)
        return (outputs, captured) if capture else outputs

    def reset(self) -> None:
        self.state.clear()


def _frees(steps: list, keep: set[int]) -> list[tuple[int, ...]]:
    """For each step, the slots it reads for the last time (freed right after it), except
    `keep` (results and constants): what bounds the interpreter's memory to the live values."""
    last_use: dict[int, int] = {}
    for idx, (_, ins, _, _) in enumerate(steps):
        for s in ins:
            last_use[s] = idx
    frees: list[list[int]] = [[] for _ in steps]
    for s, idx in last_use.items():
        if s not in keep:
            frees[idx].append(s)
    return [tuple(f) for f in frees]


def bind_input(names: tuple[str, ...], port: ov.Output, inputs: Mapping[str, np.ndarray],
               widen: bool = False) -> np.ndarray:
    given = [n for n in names if n in inputs]
    if not given:
        raise InputError(f"missing input {names[0]} ({port.get_element_type().get_type_name()}"
                         f"{port.get_partial_shape()})")
    value = np.asarray(inputs[given[0]])
    want = input_dtype(port, widen)
    if value.dtype != want:
        if not np.can_cast(value.dtype, want, casting="same_kind"):
            raise InputError(f"input {names[0]}: expected element type {want}, found {value.dtype}")
        value = value.astype(want)
    pshape = port.get_partial_shape()
    if value.ndim == 2 and pshape.rank.is_static and pshape.rank.get_length() == 3 and pshape[0].is_static \
            and any(n.rsplit(".", 1)[-1] == "position_ids" for n in names):  # an If blob's: "<model>.position_ids"
        # mRoPE's [3, B, S] given a text's [B, S]: every section the same position
        value = np.broadcast_to(value, (pshape[0].get_length(), *value.shape))
    if not pshape.compatible(ov.PartialShape(list(value.shape))):
        raise InputError(f"input {names[0]}: expected shape {pshape}, found {list(value.shape)}")
    return value


def _failure(label: str, args, exc: Exception) -> str:
    shapes = ", ".join(describe_array(a) if a is not None else "None" for a in args)
    return f"while executing {label}: {type(exc).__name__}: {exc} (inputs: {shapes})"


def check_supported(model: ov.Model) -> None:
    """Raise one UnsupportedOpError listing every op the interpreter lacks, before running anything."""
    load_all()
    missing: dict[tuple[str, str], list[str]] = {}
    for node in model.get_ordered_ops():
        tname, version = node.get_type_name(), node.get_type_info().version_id
        if tname in _BUILTIN or lookup(tname, version) is not None:
            continue
        users = sorted({i.get_node().get_friendly_name() for o in node.outputs() for i in o.get_target_inputs()})
        names = sorted({n for o in node.outputs() for n in o.get_names()})
        where = f"'{node.get_friendly_name()}'" + (f" (tensors {', '.join(names)})" if names else "")
        where += f", used by {', '.join(users[:3])}{'…' if len(users) > 3 else ''}" if users else ""
        missing.setdefault((tname, version), []).append(where)
    if missing:
        lines = [f"  {t} ({v}) ×{len(w)}: {w[0]}" + (f" and {len(w) - 1} more" if len(w) > 1 else "")
                 for (t, v), w in sorted(missing.items())]
        raise UnsupportedOpError("kvc's numpy interpreter does not implement "
                                 f"{len(missing)} op type(s) used by this model:\n" + "\n".join(lines))
