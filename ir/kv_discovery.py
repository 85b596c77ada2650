"""Discover a model's KV cache from its graph alone.

Per layer and key/value: where the cache lives (a variable, or an input/output pair), its
element type, which axis is batch and which is sequence, and the KV heads and head size.
The axes come from the graph, never from the model's name, because layouts differ
(REFERENCE.md §1: `[B,H,S,D]`, Qwen v1 `[B,S,H,D]`, ChatGLM `[S,B,H,D]`, Bloom key
`[B*H,D,S]`, GPTBigCode `[B,S,2D]`):

* sequence axis: the Concat that appends this step's rows (written -2 or 2 alike), or the
  zero-length axis of a stateful variable's initial value;
* batch axis: the beam_idx Gather's axis, or the dynamic axis of the initial value.

Layer index and key/value come from the names optimum-intel gives (`past_key_values.N.key`);
a model with other names is matched through its attention ops (SDPA input 1 is the key,
input 2 the value).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import openvino as ov

from kvc.errors import InvalidModelError

# `key_value` is GPTBigCode's fused cache; the lookahead keeps `key` from matching its prefix.
_PAST = re.compile(r"past_key_values\.(\d+)\.(key_value|key|value)(?=present|[^A-Za-z_]|$)")
_PRESENT = re.compile(r"present\.(\d+)\.(key_value|key|value)(?![A-Za-z_])")
# Ops a cache tensor flows through unchanged in meaning on its way to attention or a Concat.
_PASS_THROUGH = {"Convert", "Gather", "Reshape", "Unsqueeze", "Squeeze", "Broadcast", "Transpose",
                 "Concat", "KVCache", "GatherElements"}


@dataclass(frozen=True)
class KVTensor:
    """One cache tensor: a layer's key or value."""

    layer: int
    kind: str  # "key", "value", or "key_value" for a fused cache
    element_type: str
    shape: str
    batch_axis: int
    seq_axis: int
    heads: int | None
    head_size: int | None
    variable_id: str | None = None  # stateful models
    input_name: str | None = None  # stateless models
    output_name: str | None = None


@dataclass(frozen=True)
class KVLayout:
    stateful: bool
    tensors: tuple[KVTensor, ...]

    @property
    def num_layers(self) -> int:
        return len({t.layer for t in self.tensors})

    def get(self, layer: int, kind: str) -> KVTensor:
        for t in self.tensors:
            if t.layer == layer and t.kind == kind:
                return t
        raise KeyError((layer, kind))

    def to_dict(self) -> dict:
        return {"stateful": self.stateful, "num_layers": self.num_layers,
                "tensors": [asdict(t) for t in self.tensors]}


@dataclass
class _Candidate:
    source: ov.Output  # ReadValue output or Parameter output
    variable_id: str | None
    input_name: str | None
    output_name: str | None
    concat: ov.Node | None
    gather_axis: int | None
    init_shape: ov.PartialShape | None


def kv_layout(model: ov.Model, file: str = "<model>") -> KVLayout:
    """The KV layout of a stateful or stateless model; InvalidModelError if it has no KV cache."""
    # Variables are registered by every Model built with ReadValues (and by every IR read):
    # far cheaper than scanning the ops, which static pipelines do a dozen times per compile.
    stateful = bool(model.get_variables()) or any(n.get_type_name() == "Assign" for n in model.get_sinks())
    candidates = _stateful_candidates(model) if stateful else _stateless_candidates(model)
    if not candidates:
        raise InvalidModelError(
            "no-kv-cache", file, "found no KV cache",
            expected="ReadValue/Assign variables feeding a Concat, or past_key_values.* inputs "
                     "concatenated into outputs",
            found=f"{len(model.inputs)} inputs ({', '.join(sorted(_names(model.inputs)))}), "
                  f"{len(model.get_variables())} variables")
    labels = _labels(model, candidates, file)
    tensors = [_describe(c, labels[i], file) for i, c in enumerate(candidates)]
    tensors.sort(key=lambda t: (t.layer, t.kind != "key"))
    return KVLayout(stateful, tuple(tensors))


def _names(ports) -> list[str]:
    return [p.get_any_name() if p.get_names() else "<unnamed>" for p in ports]


def _consumers(output: ov.Output) -> list[ov.Node]:
    return [i.get_node() for i in output.get_target_inputs()]


def _const_int(output: ov.Output) -> int | None:
    node = output.get_node()
    if node.get_type_name() != "Constant":
        return None
    data = node.get_data().reshape(-1)
    return int(data[0]) if data.size == 1 else None


def _follow(source: ov.Output) -> tuple[ov.Node | None, int | None]:
    """From a cache source through optional Convert and beam Gather to the appending Concat.

    The cache enters the Concat first (past, then this step's rows); a tensor entering it
    later is the new data, not a cache.
    """
    out, gather_axis = source, None
    for _ in range(3):
        targets = list(out.get_target_inputs())
        concat = next((t.get_node() for t in targets if t.get_index() == 0
                       and t.get_node().get_type_name() in ("Concat", "KVCache")), None)
        if concat is not None:
            return concat, gather_axis
        step = next((t.get_node() for t in targets if t.get_index() == 0
                     and t.get_node().get_type_name() in ("Convert", "Gather")), None)
        if step is None:
            return None, gather_axis
        if step.get_type_name() == "Gather":
            gather_axis = _const_int(step.input_value(2))
        out = step.output(0)
    return None, gather_axis


def _stateful_candidates(model: ov.Model) -> list[_Candidate]:
    assigns = {n.get_attributes()["variable_id"]: n for n in model.get_sinks()
               if n.get_type_name() == "Assign"}
    found = []
    for node in model.get_ordered_ops():
        if node.get_type_name() != "ReadValue":
            continue
        var_id = node.get_attributes()["variable_id"]
        concat, gather_axis = _follow(node.output(0))
        if concat is None and var_id not in assigns:
            continue
        init = node.get_input_partial_shape(0) if node.get_input_size() else None
        found.append(_Candidate(node.output(0), var_id, None, None, concat, gather_axis, init))
    return found


def _stateless_candidates(model: ov.Model) -> list[_Candidate]:
    found = []
    result_of = {}
    for i, r in enumerate(model.get_results()):
        result_of[r] = model.output(i)
    for param in model.get_parameters():
        out = param.output(0)
        concat, gather_axis = _follow(out)
        if concat is None:
            continue
        result = _result_after(concat, result_of)
        if result is None:
            continue
        found.append(_Candidate(out, None, out.get_any_name(), result.get_any_name(), concat,
                                gather_axis, None))
    return found


def _result_after(concat: ov.Node, result_of: dict) -> ov.Output | None:
    """The model output the appended cache is returned as (directly or after a Convert)."""
    for consumer in _consumers(concat.output(0)):
        if consumer in result_of:
            return result_of[consumer]
        if consumer.get_type_name() == "Convert":
            for c2 in _consumers(consumer.output(0)):
                if c2 in result_of:
                    return result_of[c2]
    return None


def _labels(model: ov.Model, candidates: list[_Candidate], file: str) -> list[tuple[int, str]]:
    """(layer, kind) for each candidate: from its names, else from attention wiring."""
    labels: list[tuple[int, str] | None] = []
    for c in candidates:
        text = c.variable_id or c.input_name or ""
        m = _PAST.search(text) or _PRESENT.search(c.output_name or "")
        labels.append((int(m.group(1)), m.group(2)) if m else None)
    if all(labels):
        return labels  # type: ignore[return-value]
    by_source = {_key(c.source): i for i, c in enumerate(candidates)}
    layer = attentions = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "ScaledDotProductAttention":
            continue
        attentions += 1
        hit = False
        for port, kind in ((1, "key"), (2, "value")):
            src = _trace_to_source(node.input_value(port), by_source)
            if src is not None and labels[by_source[src]] is None:
                labels[by_source[src]] = (layer, kind)
                hit = True
        layer += hit
    missing = [c.variable_id or c.input_name for c, lab in zip(candidates, labels) if lab is None]
    fixed = [_past_name(c) for c, lab in zip(candidates, labels) if lab is None and _fixed_size(c)]
    if missing and len(fixed) == len(missing):  # a pure Mamba has no attention at all
        readers = (f"the model's {attentions} attention op{'s' if attentions != 1 else ''}" if attentions else
                   "an attention op (the model has none)")
        raise InvalidModelError(
            "not-kv-state", file, "the model keeps state that no attention reads and that does not grow along a "
            "sequence: kvc compiles attention KV caches, and a recurrent state (a Mamba layer's convolution and "
            "SSM states, as in mamba, falcon_mamba, zamba2, granitemoehybrid, falcon_h1, jamba; a short "
            "convolution's, as in lfm2; a Gated DeltaNet's, as in Qwen3.5 and Qwen3-Next) has no static form of "
            "its own: a padded prompt would run its pad rows through the scan",
            expected=f"states read as key or value by {readers}", found=", ".join(fixed))
    if missing:
        raise InvalidModelError("kv-unlabelled", file, "cannot tell the layer and key/value of some KV tensors",
                                expected="names like past_key_values.N.key or ScaledDotProductAttention consumers",
                                found=", ".join(map(str, missing)))
    return labels  # type: ignore[return-value]


def _fixed_size(c: _Candidate) -> bool:
    """A state no dimension of which but the batch is dynamic: a KV cache's sequence axis is."""
    return sum(d.is_dynamic for d in c.source.get_partial_shape()) <= 1


def _past_name(c: _Candidate) -> str:
    """A state's name without the present name optimum appends to a variable's id
    (`cache_params.past.conv.0cache_params.present.conv.0`)."""
    name = c.variable_id or c.input_name or "<unnamed>"
    return re.split(r"(?<=\d)(?=[A-Za-z_])", name, maxsplit=1)[0]


def _key(output: ov.Output) -> tuple[ov.Node, int]:
    """Outputs compare by identity of their wrapper; (node, index) is the stable key."""
    return output.get_node(), output.get_index()


def _trace_to_source(output: ov.Output, sources: dict) -> tuple[ov.Node, int] | None:
    """Walk up from an attention input through shape-only ops to a cache source."""
    stack, seen = [output], set()
    while stack:
        out = stack.pop()
        if _key(out) in sources:
            return _key(out)
        node = out.get_node()
        if node in seen or node.get_type_name() not in _PASS_THROUGH:
            continue
        seen.add(node)
        ports = range(node.get_input_size()) if node.get_type_name() in ("Concat", "KVCache") else [0]
        stack.extend(node.input_value(p) for p in ports)
    return None


def _dims(pshape: ov.PartialShape) -> list[str] | None:
    """Each dimension as OpenVINO prints it ("4", "?", "1..8"), None for a dynamic rank;
    iterating the Dimension objects costs 30x more, and layouts are taken a dozen times per
    compile."""
    if pshape.rank.is_dynamic:
        return None
    text = str(pshape)
    return text[1:-1].split(",") if text != "[]" else []


def _describe(c: _Candidate, label: tuple[int, str], file: str) -> KVTensor:
    pshape = c.source.get_partial_shape()
    dims = _dims(pshape)
    name = c.variable_id or c.input_name
    if dims is None:
        raise InvalidModelError("kv-axes", file, f"KV tensor {name} has a dynamic rank",
                                expected="a tensor of rank 3 or 4", found=f"shape {pshape}")
    rank = len(dims)
    init = _dims(c.init_shape) if c.init_shape is not None else None
    seq = None
    if c.concat is not None:
        attrs = c.concat.get_attributes()
        axis = int(attrs.get("axis", attrs.get("concat_axis", 0)))
        seq = axis + rank if axis < 0 else axis
    if seq is None and init is not None:
        zero = [i for i, d in enumerate(init) if d == "0"]
        seq = zero[0] if len(zero) == 1 else None
    batch = c.gather_axis
    if batch is not None and batch < 0:
        batch += rank
    if batch is None and init is not None:
        dyn = [i for i, d in enumerate(init) if not d.isdigit() and i != seq]
        batch = dyn[0] if len(dyn) == 1 else None
    if batch is None:
        dyn = [i for i, d in enumerate(dims) if not d.isdigit() and i != seq]
        batch = dyn[0] if len(dyn) == 1 else (0 if seq != 0 else 1)
    if seq is None:
        raise InvalidModelError("kv-axes", file, f"cannot find the sequence axis of KV tensor {name}",
                                expected="a Concat appending to it or a zero-length initial value",
                                found=f"shape {pshape}")
    rest = [dims[i] for i in range(rank) if i not in (batch, seq)]
    heads = head_size = None
    if rank == 4 and all(d.isdigit() for d in rest):
        heads, head_size = int(rest[0]), int(rest[1])
    elif rank == 3 and len(rest) == 1 and rest[0].isdigit():
        head_size = int(rest[0])
    return KVTensor(layer=label[0], kind=label[1], element_type=c.source.get_element_type().get_type_name(),
                    shape=str(pshape), batch_axis=batch, seq_axis=seq, heads=heads, head_size=head_size,
                    variable_id=c.variable_id, input_name=c.input_name, output_name=c.output_name)
