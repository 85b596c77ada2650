"""Build the static model set of a pipeline: one prefill model and sized generate variants.

    loaded model ──common passes (kvc.passes.DEFAULT_PIPELINE, or --passes)──► lifted
                    ├─ static-shape{prefill}    → tail ─► "prefill" (chunk C)
                    ├─ static-shape{prefill B}  → tail ─► "prefill-B" (per bulk chunk B)
                    ├─ static-shape{prefill F, no chunk} → tail ─► "first-F" (per first chunk F)
                    │    (rows=dynamic: static-shape{rows=dynamic} → first-tail ─► "first-F", 1..F rows)
                    └─ static-shape{generate T} → tail ─► "generate-T" (per T)

    tail: [prompt-end →] mask-positions → unmask-pad-rows → kv-io → lower-kvcache
          [→ group-attention] [→ mlp-rows] (prompt-end in the prefill branches; attention
          "split-past": group-attention{split_past=true} in every branch; "fold":
          group-attention{fold=true} in the prefill branches and {split_past=true} in the
          generate ones; prefill_mlp "rows": mlp-rows in the prefill branches)
    first-tail: prompt-end → kv-io → lower-kvcache [→ mlp-rows] → pin-rows: a prompt's first
          tokens unpadded need no mask or pad-row rewrite, and attention stays the model's own
          (group-attention needs static shapes; the CPU plugin runs the op as the stateful
          model does)

The pass objects are built from the typed options (`branch_passes`); pipeline text is only
what users type (`--passes`) and what the manifest and dumps record.

Each branch starts from a clone of the lifted model; OpenVINO clones share Constant data, so
the weights exist once in memory (memory-mapped from the input file) whatever the number of
variants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import openvino as ov

from kvc.ir.bundle import Bundle
from kvc.ir.kv_discovery import kv_layout
from kvc.ir.naming import canonicalize_friendly_names
from kvc.passes import Instrumentation, Pass, PassManager, format_pipeline, parse_pipeline
from kvc.passes.dense_experts import DenseExperts
from kvc.passes.group_attention import GroupAttention
from kvc.passes.kv_io import KVIO, scale_name
from kvc.passes.lift_state import LiftState
from kvc.passes.lower_kvcache import LowerKVCache
from kvc.passes.mask_positions import MaskPositions
from kvc.passes.mlp_rows import MlpRows
from kvc.passes.pin_rows import PinRows
from kvc.passes.prompt_end import PromptEnd
from kvc.passes.relative_alibi import RelativeAlibi
from kvc.passes.rotate_half_rope import RotateHalfRope
from kvc.passes.static_shape import StaticShape
from kvc.passes.unmask_pad_rows import UnmaskPadRows
from kvc.plan import KVSpec, StaticOptions, StaticPlan


@dataclass
class StaticModels:
    plan: StaticPlan
    models: dict[str, ov.Model]
    pipelines: dict[str, str] = field(default_factory=dict)  # model name -> pipeline text it went through

    @property
    def generate_names(self) -> dict[int, str]:
        return {int(n.split("-", 1)[1]): n for n in self.models if n.startswith("generate-")}


def common_passes(options: StaticOptions) -> list[Pass]:
    """The passes run once on the loaded model: `--passes` as typed, else lift-state,
    dense-experts, rotate-half-rope and relative-alibi (kvc.passes.DEFAULT_PIPELINE)."""
    return parse_pipeline(options.passes) if options.passes else [LiftState(beam=options.beam), DenseExperts(),
                                                                  RotateHalfRope(), RelativeAlibi()]


def branch_passes(options: StaticOptions) -> dict[str, list[Pass]]:
    """The passes of each static model, applied to the lifted model."""
    lengths = options.lengths()

    def first_tail() -> list[Pass]:
        kv_io = KVIO(kv_type=options.kv_precision, transpose_v=options.transpose_v, slice_logits=options.slice_logits)
        return [PromptEnd(), kv_io, LowerKVCache(), *([MlpRows()] if options.prefill_mlp == "rows" else []),
                PinRows()]

    def tail(prefill: bool) -> list[Pass]:
        kv_io = KVIO(kv_type=options.kv_precision, transpose_v=options.transpose_v,
                     slice_logits=prefill and options.slice_logits)
        form = options.attention  # "fold": the prefill models fold, the generate models split
        fold = form == "fold" and prefill
        split = form == "split-past" or (form == "fold" and not prefill)
        grouped = [GroupAttention(split_past=split, fold=fold)] if form in ("grouped", "split-past", "fold") else []
        rows = [MlpRows()] if prefill and options.prefill_mlp == "rows" else []
        ends = [PromptEnd()] if prefill else []
        return [*ends, MaskPositions(), UnmaskPadRows(), kv_io, LowerKVCache(), *grouped, *rows]

    branches = {"prefill": [StaticShape(kind="prefill", prompt=lengths.prompt, chunk=lengths.chunk), *tail(True)]}
    for chunk in lengths.bulk:
        branches[f"prefill-{chunk}"] = [StaticShape(kind="prefill", prompt=lengths.prompt, chunk=chunk), *tail(True)]
    for first in lengths.first:  # a prompt's first F positions over no past: the unchunked form, P = F
        if lengths.first_dynamic:
            branches[f"first-{first}"] = [StaticShape(kind="prefill", prompt=first, chunk=0, rows="dynamic"),
                                          *first_tail()]
        else:
            branches[f"first-{first}"] = [StaticShape(kind="prefill", prompt=first, chunk=0), *tail(True)]
    for size in lengths.sizes:
        branches[f"generate-{size}"] = [StaticShape(kind="generate", size=size, tokens=lengths.tokens), *tail(False)]
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
    return _build_static(model, options, instrumentation, use_env, bundle)


def _build_static(model: ov.Model, options: StaticOptions, instrumentation: Instrumentation | None,
                  use_env: bool, bundle: Bundle | None) -> StaticModels:
    lengths = options.lengths()
    common = common_passes(options)
    if bundle is not None:  # the passes keep the source's weights: start copying them now
        bundle.start_weights(model)
    run = PassManager(common, _branch_instrumentation(instrumentation, "common"),
                      use_env=use_env).run(model)
    lifted = run.model
    canonicalize_friendly_names(lifted)  # once here rather than in every branch's save
    layout = kv_layout(lifted)
    if options.kv_precision == "i8":
        calibrate_key_channels(lifted, layout)
    largest = f"generate-{lengths.sizes[-1]}"
    models, pipelines, kv = {}, {}, ()
    branches = branch_passes(options)
    for i, (name, passes) in enumerate(branches.items()):
        source = lifted if i == len(branches) - 1 else lifted.clone()  # the last branch may consume it
        branch = PassManager(passes, _branch_instrumentation(instrumentation, name), use_env=use_env).run(source)
        models[name] = branch.model
        pipelines[name] = format_pipeline(common + passes)
        if name == largest:  # the KV buffers are sized by the largest variant
            kv = _kv_specs(branch.model, layout, options)
        if bundle is not None:
            bundle.add(name, branch.model)
    return StaticModels(StaticPlan(options, lengths, kv), models, pipelines)


CALIBRATION_PROMPTS, CALIBRATION_TOKENS = 2, 64


def calibrate_key_channels(lifted: ov.Model, layout) -> None:
    """For int8 KV: the magnitude of every key channel (max |k| per head and channel over
    CALIBRATION_PROMPTS seeded random prompts of CALIBRATION_TOKENS tokens, on OpenVINO CPU at
    f32), recorded on each key's past input for kv-io to equalize channels with. Computed once,
    before the branches, so every static model quantizes the shared cache alike; the same model
    gives the same numbers (seeded, exact arithmetic)."""
    import numpy as np

    from kvc.passes.kv_io import CHANNEL_ABSMAX
    from kvc.runtime.generate import first_step_feed
    from kvc.runtime.session import OpenVINOSession

    session = OpenVINOSession(lifted)
    vocab = lifted.output("logits").get_partial_shape()[-1].get_length()
    rng = np.random.default_rng(0)
    keys = [t for t in layout.tensors if t.kind == "key"]
    absmax: dict[str, np.ndarray] = {}
    for _ in range(CALIBRATION_PROMPTS):
        out = session.infer(first_step_feed(session, rng.integers(0, vocab, CALIBRATION_TOKENS)))
        for t in keys:
            rows = np.abs(np.asarray(out[t.output_name], np.float32))
            m = rows.max(axis=(t.batch_axis, t.seq_axis))
            absmax[t.input_name] = np.maximum(absmax.get(t.input_name, m), m)
    params = {p.output(0).get_any_name(): p for p in lifted.get_parameters()}
    for name, m in absmax.items():
        params[name].get_rt_info()[CHANNEL_ABSMAX] = ",".join(repr(float(v)) for v in m.reshape(-1))


def _kv_specs(largest: ov.Model, layout, options: StaticOptions) -> tuple[KVSpec, ...]:
    ports = {p.get_any_name(): p for p in largest.inputs}
    specs = []
    for t in layout.tensors:
        past = ports[t.input_name]
        seq = t.seq_axis
        if options.transpose_v and t.kind == "value":
            seq = len(past.get_partial_shape()) - 1
        specs.append(KVSpec(t.input_name, t.output_name, t.layer, t.kind, seq,
                            past.get_element_type().get_type_name(), tuple(past.get_shape())))
        scales = ports.get(scale_name(t.input_name))
        if scales is not None:  # int8 KV: the per-token scales are cache rows too
            specs.append(KVSpec(scale_name(t.input_name), scale_name(t.output_name), t.layer, f"{t.kind}_scale", seq,
                                scales.get_element_type().get_type_name(), tuple(scales.get_shape())))
    return tuple(specs)
