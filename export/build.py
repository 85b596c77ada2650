"""Build the static model set of a pipeline: one prefill model and sized generate variants.

    loaded model ──common passes (lift-state, ...)──► lifted model
                    ├─ static-shape{prefill} → kv-io → lower-kvcache ─► "prefill"
                    └─ static-shape{generate T} → kv-io → lower-kvcache ─► "generate-T" (per T)

Each branch starts from a clone of the lifted model; OpenVINO clones share Constant data, so
the weights exist once in memory (memory-mapped from the input file) whatever the number of
variants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import openvino as ov

from kvc.errors import UsageError
from kvc.ir import collector
from kvc.ir.bundle import Bundle
from kvc.ir.kv_discovery import kv_layout
from kvc.ir.naming import canonicalize_friendly_names
from kvc.passes import Instrumentation, PassManager, parse_pipeline
from kvc.passes.static_shape import LengthPlan, plan_lengths
from kvc.runtime.static_pipeline import KVSpec


@dataclass(frozen=True)
class StaticOptions:
    """What `kvc compile` asks of the static pipeline (names follow NPUW's properties)."""

    max_prompt_len: int = 1024
    min_response_len: int = 128
    prefill_chunk_size: int = 0
    variants: str | tuple[int, ...] = "single"
    kv_precision: str = "f32"
    transpose_v: bool = False
    slice_logits: bool = True  # NPUW slices prefill logits to the last token (or cuts the head)
    beam: str = "drop"
    passes: str | None = None  # the common pipeline; default: lift-state{beam=<beam>}
    attention: str = "grouped"  # "grouped": group-attention rewrites SDPA; "sdpa": kept as is

    def __post_init__(self) -> None:
        if self.beam != "drop":
            raise UsageError(
                f"beam={self.beam} cannot be compiled: the static contract runs batch 1 (REFERENCE.md §4), where "
                f"beam_idx is always [0] and its Gathers reorder nothing, and an empty prefill past cannot feed "
                f"them; use beam=drop (the default). Beam reordering stays available on stateful models as the "
                f"passes lift-state{{beam=keep}} and fuse-kvcache{{beam=indirect}} (kvc passes)")

    def common_pipeline(self) -> str:
        return self.passes or ("lift-state" if self.beam == "drop" else f"lift-state{{beam={self.beam}}}")

    def kv_io(self, prefill: bool) -> str:
        opts = [f"kv_type={self.kv_precision}"]
        if self.transpose_v:
            opts.append("transpose_v=true")
        if prefill and self.slice_logits:
            opts.append("slice_logits=true")
        return "kv-io{" + ",".join(opts) + "}"

    def plan(self) -> LengthPlan:
        return plan_lengths(self.max_prompt_len, self.min_response_len, self.prefill_chunk_size, self.variants)


@dataclass
class StaticModels:
    plan: LengthPlan
    models: dict[str, ov.Model]
    kv: list[KVSpec]
    pipelines: dict[str, str] = field(default_factory=dict)  # model name -> pipeline text it went through

    @property
    def generate_names(self) -> dict[int, str]:
        return {int(n.split("-", 1)[1]): n for n in self.models if n.startswith("generate-")}


def branch_pipelines(options: StaticOptions) -> dict[str, str]:
    """The pipeline text of each static model, applied to the lifted model."""
    plan = options.plan()
    tail = "mask-positions,unmask-pad-rows,{kv_io},lower-kvcache"
    if options.attention == "grouped":
        tail += ",group-attention"
    branches = {"prefill": f"static-shape{{kind=prefill,prompt={plan.prompt},chunk={plan.chunk}}},"
                           + tail.format(kv_io=options.kv_io(prefill=True))}
    for size in plan.sizes:
        branches[f"generate-{size}"] = (f"static-shape{{kind=generate,size={size},tokens={plan.tokens}}},"
                                        + tail.format(kv_io=options.kv_io(prefill=False)))
    return branches


def _branch_instrumentation(base: Instrumentation | None, sub: str) -> Instrumentation | None:
    if base is None:
        return None
    return dataclasses.replace(base, dump_dir=Path(base.dump_dir) / sub if base.dump_dir is not None else None)


def build_static(model: ov.Model, options: StaticOptions = StaticOptions(),
                 instrumentation: Instrumentation | None = None, *, use_env: bool = True,
                 bundle: Bundle | None = None) -> StaticModels:
    """Run the common passes once, then one branch per static model. `model` is consumed.

    With a `bundle`, the weights of `model` start being copied into it before any pass runs
    (unless `kvc.ir.load` already started them), and each static model is added to it as soon
    as it is built (saving overlaps the passes; `bundle.commit()` finishes)."""
    with collector.paused():
        return _build_static(model, options, instrumentation, use_env, bundle)


def _build_static(model: ov.Model, options: StaticOptions, instrumentation: Instrumentation | None,
                  use_env: bool, bundle: Bundle | None) -> StaticModels:
    plan = options.plan()
    common = options.common_pipeline()
    if bundle is not None:  # the passes keep the source's weights: start copying them now
        bundle.start_weights(model)
    run = PassManager(parse_pipeline(common), _branch_instrumentation(instrumentation, "common"),
                      use_env=use_env).run(model)
    lifted = run.model
    canonicalize_friendly_names(lifted)  # once here rather than in every branch's save
    layout = kv_layout(lifted)
    largest = f"generate-{plan.sizes[-1]}"
    result = StaticModels(plan, {}, [])
    branches = branch_pipelines(options)
    for i, (name, pipeline) in enumerate(branches.items()):
        source = lifted if i == len(branches) - 1 else lifted.clone()  # the last branch may consume it
        branch = PassManager(parse_pipeline(pipeline), _branch_instrumentation(instrumentation, name),
                             use_env=use_env).run(source)
        result.models[name] = branch.model
        result.pipelines[name] = f"{common},{pipeline}"
        if name == largest:  # the KV buffers are sized by the largest variant
            result.kv = _kv_specs(branch.model, layout, options)
        if bundle is not None:
            bundle.add(name, branch.model)
    return result


def _kv_specs(largest: ov.Model, layout, options: StaticOptions) -> list[KVSpec]:
    ports = {p.get_any_name(): p for p in largest.inputs}
    specs = []
    for t in layout.tensors:
        past = ports[t.input_name]
        seq = t.seq_axis
        if options.transpose_v and t.kind == "value":
            seq = len(past.get_partial_shape()) - 1
        specs.append(KVSpec(t.input_name, t.output_name, t.layer, t.kind, seq,
                            past.get_element_type().get_type_name(), tuple(past.get_shape())))
    return specs
