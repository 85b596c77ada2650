"""The plan of a static pipeline: the contract between the compiler, the manifest and the runtime.

    StaticOptions   what the user asks (names follow NPUW's properties)
    LengthPlan      the effective lengths: P, R, chunk C, generate sizes, tokens per step G,
                    with every adjustment made to what was asked
    KVSpec          one cache tensor as the static models store it (after kv-io)
    StaticPlan      all three: what `kvc compile` builds, what the manifest's "plan" section
                    serializes (`to_dict`/`from_dict`, versioned), what a StaticPipeline runs

This module depends on nothing else in kvc but its errors, so passes, export and runtime all
import it and none of them owns it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvc.errors import UsageError

PLAN_VERSION = 1

NPUW_ALIGN = 64
DEFAULT_MAX_PROMPT_LEN = 1024
DEFAULT_MIN_RESPONSE_LEN = 128
PYRAMID_BASE = 1024


@dataclass(frozen=True)
class StaticOptions:
    """What `kvc compile` asks of the static pipeline (names follow NPUW's properties)."""

    max_prompt_len: int | None = None  # None: DEFAULT_MAX_PROMPT_LEN, lowered to fit max_positions
    min_response_len: int | None = None  # None: DEFAULT_MIN_RESPONSE_LEN
    prefill_chunk_size: int | tuple[int, ...] = 0  # several: the smallest is the chunk, the others bulk chunks
    prefill_first: tuple[int, ...] = ()  # first-chunk prefill models: a prompt's first F tokens, no past read
    # "dynamic": one first-chunk model whose rows are dynamic, 1 to F (CPU-only compiles): a
    # prompt's first call computes its own tokens, not F; "static": each first chunk F rows
    prefill_first_rows: str = "static"
    variants: str | tuple[int, ...] = "pyramid"  # NPUW_LLM_GENERATE_PYRAMID's default (YES) in OpenVINO 2026.4
    kv_precision: str = "f32"
    transpose_v: bool = False
    slice_logits: bool = True  # NPUW slices prefill logits to the last token (or cuts the head)
    beam: str = "drop"
    passes: str | None = None  # the common pipeline as text; default: lift-state
    # "grouped": group-attention rewrites SDPA; "split-past": the same, and every model with a
    # past reads it and the new rows apart (group-attention{split_past=true}); "fold": the
    # prefill models fold the GQA repeat into their query rows (group-attention{fold=true}) and
    # the generate models split; "sdpa": kept as is
    attention: str = "grouped"
    # "rows": the prefill models' gated MLPs multiply 2-D rows (mlp-rows), which the CPU
    # plugin keeps off its LLMMLP fusion and its second copy of the weights; "as-is": kept
    prefill_mlp: str = "as-is"
    max_positions: int | None = None  # the positions the model was built for (its config.json), when known
    # LongRoPE's original positions T (its config.json), when the model has them: a prompt's rows
    # rotate at the long factors when its end reaches T (kvc.passes.prompt_end), so a cache
    # keys rows by that side (kvc.cache.serving)
    longrope_switch: int | None = None

    def __post_init__(self) -> None:
        if self.beam != "drop":
            raise UsageError(
                f"beam={self.beam} cannot be compiled: the static contract runs batch 1 (REFERENCE.md §4), where "
                f"beam_idx is always [0] and its Gathers reorder nothing, and an empty prefill past cannot feed "
                f"them; use beam=drop (the default). Beam reordering stays available on stateful models as the "
                f"passes lift-state{{beam=keep}} and fuse-kvcache{{beam=indirect}} (kvc passes)")

    def lengths(self) -> "LengthPlan":
        return plan_lengths(self.max_prompt_len, self.min_response_len, self.prefill_chunk_size, self.variants,
                            max_positions=self.max_positions, first=self.prefill_first,
                            first_rows=self.prefill_first_rows)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}  # as JSON reads

    @classmethod
    def from_dict(cls, d: dict) -> "StaticOptions":
        d = dict(d)
        for key in ("variants", "prefill_chunk_size", "prefill_first"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        return cls(**d)


def _align_up(value: int, to: int) -> int:
    return -(-value // to) * to


@dataclass(frozen=True)
class LengthPlan:
    """Effective lengths of a static pipeline, with every change from what the user asked."""

    prompt: int  # P
    response: int  # R
    chunk: int  # C, 0 without chunked prefill
    sizes: tuple[int, ...]  # generate variants T1 < ... < Tn (Tn = P + R)
    tokens: int = 1  # G
    notes: tuple[str, ...] = field(default=())
    bulk: tuple[int, ...] = ()  # larger prefill chunks C < B1 < ... < P, each its own prefill model
    first: tuple[int, ...] = ()  # first-chunk models F1 < ... < P: positions [0, F), no past
    first_dynamic: bool = False  # the one first-chunk model takes 1 to F rows (`plan_lengths`)

    @property
    def capacity(self) -> int:
        return self.sizes[-1]

    def to_dict(self) -> dict:
        return {"max_prompt_len": self.prompt, "min_response_len": self.response, "prefill_chunk_size": self.chunk,
                "prefill_bulk_chunks": list(self.bulk), "prefill_first_chunks": list(self.first),
                **({"prefill_first_rows": "dynamic"} if self.first_dynamic else {}),
                "generate_sizes": list(self.sizes),
                "tokens_per_step": self.tokens, "capacity": self.capacity, "adjustments": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict) -> "LengthPlan":
        sizes = d["generate_sizes"]
        if not (isinstance(sizes, list) and sizes and all(_is_int(s) and s > 1 for s in sizes)
                and sizes == sorted(set(sizes))):
            raise ValueError(f"generate_sizes must be increasing integers > 1, found {sizes!r}")
        ints = {k: d[k] for k in ("max_prompt_len", "min_response_len", "prefill_chunk_size", "tokens_per_step")}
        for key, value in ints.items():
            if not _is_int(value) or value < 0:
                raise ValueError(f"{key} must be a non-negative integer, found {value!r}")
        if not (isinstance(d["adjustments"], list) and all(isinstance(a, str) for a in d["adjustments"])):
            raise ValueError("adjustments must be a list of strings")
        bulk = d.get("prefill_bulk_chunks", [])  # absent from manifests written before bulk chunks
        if not (isinstance(bulk, list) and all(_is_int(b) for b in bulk) and bulk == sorted(set(bulk))):
            raise ValueError(f"prefill_bulk_chunks must be increasing integers, found {bulk!r}")
        first = d.get("prefill_first_chunks", [])  # absent from manifests written before first chunks
        if not (isinstance(first, list) and all(_is_int(f) for f in first) and first == sorted(set(first))):
            raise ValueError(f"prefill_first_chunks must be increasing integers, found {first!r}")
        rows = d.get("prefill_first_rows", "static")  # absent: static (and from manifests before dynamic rows)
        if rows not in ("static", "dynamic") or (rows == "dynamic" and len(first) != 1):
            raise ValueError(f"prefill_first_rows must be static, or dynamic with one first chunk, found {rows!r} "
                             f"with first chunks {first!r}"[:200])
        plan = cls(d["max_prompt_len"], d["min_response_len"], d["prefill_chunk_size"], tuple(sizes),
                   d["tokens_per_step"], tuple(d["adjustments"]), tuple(bulk), tuple(first), rows == "dynamic")
        if plan.prompt < 1 or plan.tokens < 1 or plan.capacity <= plan.prompt:
            raise ValueError(f"lengths are inconsistent: P {plan.prompt}, G {plan.tokens}, capacity {plan.capacity}")
        if bulk and not (plan.chunk and plan.chunk < bulk[0] and bulk[-1] < plan.prompt):
            raise ValueError(f"bulk chunks {bulk} must lie between the chunk {plan.chunk} and P {plan.prompt}")
        if first and not (plan.chunk and first[0] > 0 and first[-1] < plan.prompt):
            raise ValueError(f"first chunks {first} must lie between 0 and P {plan.prompt}, with a chunk")
        return plan


def chunk_label(chunk, bulk=(), first=(), dynamic: bool = False) -> str:
    """Prefill chunks as every output shows them: "64", "64 + bulk 512", "16 + bulk 128 +
    first 128", "32 + bulk 256 + first 1..256" (a first chunk of dynamic rows), "none".
    `chunk` may be a manifest's lengths (a dict), or the sizes of --prefill-chunk-size (an
    int or a tuple: the chunk, then the bulk chunks)."""
    if isinstance(chunk, dict):
        chunk, bulk, first, dynamic = (chunk.get("prefill_chunk_size"), chunk.get("prefill_bulk_chunks") or (),
                                       chunk.get("prefill_first_chunks") or (),
                                       chunk.get("prefill_first_rows") == "dynamic")
    elif isinstance(chunk, tuple):
        chunk, bulk = chunk[0], chunk[1:]
    return (f"{chunk or 'none'}" + "".join(f" + bulk {b}" for b in bulk)
            + "".join(f" + first {'1..' if dynamic else ''}{f}" for f in first))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_LENGTH = 1 << 20  # P + R beyond a million positions is a typo, not a model


def plan_lengths(max_prompt_len: int | None = None, min_response_len: int | None = None,
                 chunk: int | tuple[int, ...] = 0, variants: str | tuple[int, ...] = "pyramid",
                 align: int = NPUW_ALIGN, max_positions: int | None = None, first: tuple[int, ...] = (),
                 first_rows: str = "static") -> LengthPlan:
    """NPUW's length rules: P and R aligned up to 64 (`align`), the chunk a power of two and P
    aligned up to it; variants "single" (T = P + R), "pyramid" (1024 * 2^k + R up to T), or
    explicit sizes (each ≤ T, T added). Every adjustment is recorded in `notes`.

    "pyramid" is NPUW_LLM_GENERATE_PYRAMID, on by default in OpenVINO 2026.4: after the
    alignments, `for (base = 1024; base + R <= P + R; base *= 2) sizes.push_back(base + R)`,
    then P + R when the last size is smaller (npuw/llm_compiled_model.cpp,
    create_generate_model_variants, openvinotoolkit/openvino 007c23c3). So P 1024, R 128 has
    one variant, 1152; P 2048: 1152 and 2176; P 4096, R 256: 1280, 2304, 4352. At run time
    the smallest variant with T >= prompt + R serves, moving up one when its past fills
    (npuw/llm_infer_request.cpp, select_generate_request; kvc.runtime.static_pipeline).

    Unset lengths (None) are NPUW's defaults, P = 1024 and R = 128, except that when neither is
    set and the model states fewer `max_positions` than P + R, P is lowered (in steps of
    `align`, not below one step or the chunk) so that P + R fits: the defaults never build
    positions the model was not built for. Lengths the user sets are kept as asked.

    Several chunk sizes (a tuple; kvc's own, not NPUW's): the smallest is the chunk C as
    above, the larger ones are bulk chunks, each a prefill model of its own that long prompts
    run in fewer calls (`prefill_calls`); a bulk chunk must leave a past (be below P), else it
    is dropped with a note, and P is aligned up to the largest one kept (the static-shape
    pass's rule for every chunk: P 1728 with the CPU's default bulk chunk of 128 became 1792;
    the lowering to fit `max_positions` steps by it when it fits).

    First chunks F (kvc's own): prefill models of F tokens with no past, for a prompt's first
    positions `[0, F)`: their attention reads the prompt alone, where a chunk model's reads
    its P - C past slots too, empty or not. Each must be below P (else dropped with a
    note), of any size: the calls after it start where it ends (`prefill_calls`); without a
    chunk they are dropped (the whole prompt is one call over no past already). With
    `first_rows` "dynamic" there is one first chunk F, whose model takes any number of rows
    from 1 to F: a prompt's first call computes its own tokens, unpadded; an F not below P is
    lowered to P - C (with a note), so that the bundled model's P of 128 keeps one."""
    notes = []
    sizes_asked = tuple(sorted(set(chunk))) if isinstance(chunk, tuple) else (chunk,)
    if not sizes_asked or any(not _is_int(c) or c < 0 or (c and c & (c - 1)) for c in sizes_asked):
        shown = ",".join(map(str, sizes_asked)) if isinstance(chunk, tuple) else chunk
        raise UsageError(f"prefill chunk size must be a power of two, got {shown}")
    if len(sizes_asked) > 1 and sizes_asked[0] == 0:
        raise UsageError(f"prefill chunk sizes {list(sizes_asked)}: 0 (the whole prompt at once) cannot be combined "
                         f"with chunks")
    chunk, bulk = sizes_asked[0], sizes_asked[1:]
    fit = max_prompt_len is None and min_response_len is None and max_positions
    max_prompt_len = DEFAULT_MAX_PROMPT_LEN if max_prompt_len is None else max_prompt_len
    min_response_len = DEFAULT_MIN_RESPONSE_LEN if min_response_len is None else min_response_len
    if fit and max_prompt_len + min_response_len > max_positions:
        step = max(align, chunk, 1)
        room = max_positions - min_response_len
        step = max([step] + [b for b in bulk if room // b * b > b][-1:])  # the largest bulk chunk that still fits
        lowered = max(step, room // step * step)
        if lowered <= room:
            notes.append(f"max prompt length {max_prompt_len} lowered to {lowered} so that P + R fits the model's "
                         f"{max_positions} positions (config.json); --max-prompt-len sets it")
        else:  # not even one step fits: the least P, and the compile's warning says P + R does not fit
            notes.append(f"max prompt length {max_prompt_len} lowered to {lowered}, the least it can be: P + R "
                         f"cannot fit the model's {max_positions} positions (config.json) with a min response "
                         f"length of {min_response_len}")
        max_prompt_len = lowered
    if max_prompt_len <= 0 or min_response_len <= 0:
        raise UsageError(f"max prompt length and min response length must be positive "
                         f"(got {max_prompt_len} and {min_response_len})")
    if max_prompt_len + min_response_len > MAX_LENGTH:
        raise UsageError(f"max prompt length {max_prompt_len} + min response length {min_response_len} "
                         f"(--max-prompt-len, --min-response-len) exceed {MAX_LENGTH} positions; the static models "
                         f"would not fit in memory")
    p = _align_up(max_prompt_len, align) if align > 1 else max_prompt_len
    if p != max_prompt_len:
        notes.append(f"max prompt length {max_prompt_len} aligned up to {p} (multiple of {align})")
    if chunk:
        if chunk > p:
            raise UsageError(f"prefill chunk size {chunk} exceeds the max prompt length {p}")
        p2 = _align_up(p, chunk)
        if p2 != p:
            notes.append(f"max prompt length {p} aligned up to {p2} (multiple of the chunk size {chunk})")
        p = p2
        kept = tuple(b for b in bulk if b < p)
        if kept != bulk:
            notes.append(f"prefill bulk chunk {', '.join(str(b) for b in bulk if b >= p)} dropped: not below the max "
                         f"prompt length {p}")
        bulk = kept
        p3 = _align_up(p, bulk[-1]) if bulk else p  # the static-shape pass's rule, for every chunk
        if p3 != p:
            notes.append(f"max prompt length {p} aligned up to {p3} (multiple of the bulk chunk {bulk[-1]})")
        p = p3
        if chunk == p:  # one chunk with an empty past: the whole prompt at once
            notes.append(f"prefill chunk size {chunk} is the max prompt length: the whole prompt at once")
            chunk = 0
    asked_first = tuple(sorted(set(first)))
    if any(not _is_int(f) or f <= 0 for f in asked_first):
        raise UsageError(f"first prefill chunks must be positive sizes, got {list(first)}")
    if first_rows not in ("static", "dynamic"):
        raise UsageError(f"first prefill chunk rows must be static or dynamic, got {first_rows!r}")
    if first_rows == "dynamic" and len(asked_first) > 1:
        raise UsageError(f"a first prefill chunk of dynamic rows is one size, 1 to F rows; got first chunks "
                         f"{list(asked_first)}")
    if first_rows == "dynamic" and chunk and len(asked_first) == 1 and asked_first[0] >= p > chunk:
        notes.append(f"first prefill chunk {asked_first[0]} lowered to {p - chunk}: its rows are dynamic, up to "
                     f"the max prompt length {p} less one chunk")
        asked_first = (p - chunk,)
    first = tuple(f for f in asked_first if chunk and f < p)
    for f in asked_first:
        why = ("the prefill is not chunked" if not chunk else f"not below the max prompt length {p}" if f >= p
               else None)
        if why:
            notes.append(f"first prefill chunk {f} dropped: {why}")
    r = _align_up(min_response_len, align) if align > 1 else min_response_len
    if r != min_response_len:
        notes.append(f"min response length {min_response_len} aligned up to {r} (multiple of {align})")
    total = p + r
    if variants == "single":
        sizes = (total,)
    elif variants == "pyramid":
        sizes = tuple(sorted({PYRAMID_BASE * 2 ** k + r for k in range(32) if PYRAMID_BASE * 2 ** k + r < total}
                             | {total}))
    else:
        asked = tuple(sorted(set(int(v) for v in variants)))
        if not asked or asked[0] <= 1:
            raise UsageError(f"generate variant sizes must be > 1, got {list(asked)}")
        if asked[-1] > total:
            raise UsageError(f"generate variant {asked[-1]} exceeds the KV capacity P + R = {p} + {r} = {total}")
        sizes = tuple(sorted(set(asked) | {total}))
        if total not in asked:
            notes.append(f"generate variant {total} (= P + R) added: the largest variant must hold the capacity")
    return LengthPlan(p, r, chunk, sizes, 1, tuple(notes), bulk, first, first_rows == "dynamic" and bool(first))


@dataclass(frozen=True)
class KVSpec:
    """One cache tensor as the static models store it (after kv-io)."""

    input: str  # past_key_values.N.key
    output: str  # present.N.key
    layer: int
    kind: str
    seq_axis: int
    element_type: str
    shape: tuple[int, ...]  # with the sequence axis at full capacity (largest variant's past)

    def to_dict(self) -> dict:
        return {"input": self.input, "output": self.output, "layer": self.layer, "kind": self.kind,
                "seq_axis": self.seq_axis, "element_type": self.element_type, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict) -> "KVSpec":
        spec = cls(d["input"], d["output"], d["layer"], d["kind"], d["seq_axis"], d["element_type"], tuple(d["shape"]))
        if not (isinstance(spec.input, str) and isinstance(spec.output, str) and isinstance(spec.element_type, str)
                and _is_int(spec.layer) and _is_int(spec.seq_axis) and spec.shape
                and all(_is_int(n) and n >= 0 for n in spec.shape) and 0 <= spec.seq_axis < len(spec.shape)):
            raise ValueError(f"malformed KV entry {d!r}"[:200])
        return spec


@dataclass(frozen=True)
class StaticPlan:
    """Options, effective lengths and KV layout of one compiled pipeline."""

    options: StaticOptions
    lengths: LengthPlan
    kv: tuple[KVSpec, ...]

    @property
    def kv_element_types(self) -> list[str]:
        return [k.element_type for k in self.kv]

    def to_dict(self) -> dict:
        return {"version": PLAN_VERSION, "options": self.options.to_dict(), "lengths": self.lengths.to_dict(),
                "kv": [k.to_dict() for k in self.kv]}

    @classmethod
    def from_dict(cls, d: dict) -> "StaticPlan":
        """The plan a manifest recorded; a KeyError/TypeError/ValueError on malformed input
        (the manifest reader turns it into an error naming the file)."""
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {d.get('version')!r}, expected {PLAN_VERSION}")
        return cls(StaticOptions.from_dict(d["options"]), LengthPlan.from_dict(d["lengths"]),
                   tuple(KVSpec.from_dict(k) for k in d["kv"]))


__all__ = ["StaticOptions", "LengthPlan", "KVSpec", "StaticPlan", "plan_lengths", "chunk_label", "PLAN_VERSION"]
