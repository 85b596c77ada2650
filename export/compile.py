"""`kvc compile` as a library call: model in, complete compiled directory out (or nothing).

    OUT/prefill.xml, OUT/generate-<T>.xml   static IR, all reading OUT/weights.bin
    OUT/weights.bin                          every weight once
    OUT/<model>.<DEVICE>.blob                compiled blobs (CPU: weightless, reads weights.bin)
    OUT/prefill+prefill-<B>+first-<F>….CPU.blob  the prefill models (chunk, bulk and first
                                             chunks): one CPU blob, their weights packed once
                                             (export/branches.py)
    OUT/dumps/                               pass-by-pass IR dumps, when asked for
    OUT/manifest.json                        written last (kvc.export.manifest)

Everything is written into a temporary sibling directory that is renamed to OUT only when
complete, so OUT is either the whole result or absent. Before it is published, the static IR
is verified against the source and every blob is imported the way `kvc run` imports it and
run on the same probes; a failure of either publishes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvc import __version__, jsontext
from kvc.errors import InvalidModelError, OutputError, UsageError, VerificationError
from kvc.export.blob_cache import BlobCache, blob_key, const_ranges, group_key, keyable
from kvc.export.branches import branch_groups
from kvc.export.build import build_static, common_passes
from kvc.export.device_compile import DeviceCompiler
from kvc.export.mapped import pages_released, trim_heap
from kvc.export.manifest import (FORMAT, MANIFEST, TOKENIZER_FILES, BackgroundHashes, dumps, kvc_build,
                                 openvino_version, port_table, source_files)
from kvc.ir.bundle import WEIGHTS_FILE, Bundle
from kvc.ir.finite import check_no_nan_weights
from kvc.ir.reader import core, load, resolve
from kvc.ir.writer import fsync_dir, temp_dir, write_bytes_atomic
from kvc.passes import Instrumentation, PassFailure, format_pipeline
from kvc.plan import StaticOptions
from kvc.runtime.embeddings import embedder_of, language_config
from kvc.runtime.ops import products
from kvc.runtime.session import EXACT_CPU_CONFIG, NPUW_CPU_CONFIG

DEVICES = ("CPU", "NPU")
# Embedded in weightless CPU blobs (embed_small_constants): among them the mask rows each
# generate variant has of its own (its size in bytes), which move in weights.bin when a
# variant is added, so that the other blobs stay the same (kvc.export.blob_cache).
SMALL_CONSTANT_BYTES = 16 << 10


def device_config(device: str, *, for_export: bool, precision: str = "f32") -> dict:
    """How kvc compiles for a device: CPU at `precision` ("f32": exact; "auto": the plugin's
    default), weightless blobs; NPU through the real plugin when an NPU is present, else
    through NPUW with CPU as its backend (f32), weightless."""
    if precision not in PRECISIONS:
        raise UsageError(f"unknown inference precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if device == "CPU":
        config = (dict(EXACT_CPU_CONFIG) if precision == "f32" else
                  {} if precision == "auto" else {"INFERENCE_PRECISION_HINT": precision})
        return {**config, **({"CACHE_MODE": "OPTIMIZE_SIZE"} if for_export else {})}
    if device == "NPU":
        return {} if "NPU" in core().available_devices else {**NPUW_CPU_CONFIG, **NPUW_WEIGHTLESS}
    raise UsageError(f"unknown device {device!r}; kvc compiles for {', '.join(DEVICES)}")


# NPUW exports a blob without its weights only when weights are closures of function calls
# (NPUW_CWAI, or NPUW_FOLD) and every subgraph is a call (NPUW_FUNCALL_FOR_ALL: without an
# online partitioning there is one); CACHE_MODE=OPTIMIZE_SIZE alone changes nothing. Import
# then reads the weights from WEIGHTS_PATH (npuw/compiled_model.cpp: can_use_weightless_flow,
# CompiledModelDesc::serialize, make_import_weights_ctx). CWAI rather than FOLD: FOLD changes
# generate logits by up to 7e-4 and fails on int4 weights with zero points ("Tensor was not
# initialized"). Used from the IR too, so a blob and its IR compute the same.
NPUW_WEIGHTLESS = {"NPUW_CWAI": "YES", "NPUW_FUNCALL_FOR_ALL": "YES"}


def export_config(device: str, precision: str, weights_sha256: Callable[[], str],
                  integer_weights: bool = True) -> dict:
    """How `kvc compile` compiles the blobs for `device` (`device_config`), with NPUW's weights
    bank named for the weights file's content (`weights_sha256`, asked only for NPUW).

    NPUW holds the weights its subgraphs take as closures in a bank (NPUW_WEIGHTS_BANK); a
    bank with a name is one for every compiled model of the process that names it
    (npuw/weights_bank.cpp, BankManager; NPUW_LLM names one for its prefill and generate
    models), and a blob records its bank's name, which its import takes up
    (npuw/compiled_model.cpp, the weightless deserialization). Unnamed, each model had a bank
    of its own: opening the 250M Llama's NPU blobs (NPUW on its CPU backend, `open_compiled`,
    alternating fresh processes) peaked at 3992 MB and held 2974 after a prompt, in 3.7-5.0 s;
    named, 3054 MB and 2036, in 1.9-2.2 s, the same tokens and logits. The name is the first 16
    hex digits of the weights' sha256, so models of two directories never share a bank unless
    their weights are the same bytes.

    The CPU plugin's default quantizes activations to 8 bits where weights are stored as
    integers (DYNAMIC_QUANTIZATION_GROUP_SIZE 32): a deployment's choice, kept for int8 and int4
    weights and judged as reduced arithmetic (`kvc.runtime.compare.dynamic_quantization`).
    Without `integer_weights` it changes nothing, and the CPU blobs say so with a group size of
    0: computing at f32, they are judged exactly."""
    config = device_config(device, for_export=True, precision=precision)
    if device == "CPU" and not integer_weights:
        config.setdefault("DYNAMIC_QUANTIZATION_GROUP_SIZE", "0")
    if config.get("NPU_USE_NPUW") == "YES":
        config["NPUW_WEIGHTS_BANK"] = f"kvc-{weights_sha256()[:16]}"
    return config


# The element types NNCF stores int8 and int4 weights in (a Convert decompresses them).
_INTEGER_WEIGHTS = frozenset({"i8", "u8", "i4", "u4"})


def integer_weights(model) -> bool:
    """Whether `model` holds weights stored as integers: a Constant of i8, u8, i4 or u4 that a
    Convert decompresses (NNCF's int8 and int4 formats)."""
    for op in model.get_ops():
        if (op.get_type_name() == "Constant" and op.get_output_element_type(0).get_type_name() in _INTEGER_WEIGHTS
                and any(t.get_node().get_type_name() == "Convert" for t in op.output(0).get_target_inputs())):
            return True
    return False


def blob_name(model: str, device: str) -> str:
    return f"{model}.{device}.blob"


PRECISIONS = ("auto", "f32", "bf16", "f16")


# The CPU's default prefill chunks, measured on the 250M Llama (docs/benchmarks.md). A call
# costs a pass over the weights plus its rows' work, and on the CPU every prefill model is a
# compiled model holding its own packed weights. At f32 (AVX2 host) one chunk of 32 (the best
# worst-case TTFT of one size over prompts of 16 to 1000 tokens, bench/ttft.py: 1.82x; 16:
# 2.25x, 64: 3.11x) and a bulk chunk of 512 for long prompts (512 tokens 1.69x -> 0.92x, 1000
# 1.48x -> 0.85x). At bf16 a chunk of 16 (a short prompt is one 16-row call), a bulk chunk of
# 128, and first chunks of 16 and 128 (CPU_FIRST): a 128-row call over a past reads all P slots, so
# a 100-token prompt's one call cost 167 ms on a compute-bound host (AVX512_BF16, no AMX)
# where the first-chunk model, reading the prompt alone, costs 138 (the stateful model 131).
# The 512 bulk chunk it replaces saved nothing there (one 512-row call 650 ms, four 128-row
# ones 640), and the chunk, bulk chunk and first chunk are one CPU blob with one packing of the
# weights (export/branches.py): four models, two packings (opening held 1125 MB against 1508
# with three, 1961 with four). A first chunk of 16 too: a prompt of up to 16 tokens then reads
# no past (the chunk model's 16 rows attend over P slots and the If copies its past in and out):
# 7 / 16 tokens 1.92x / 1.38x -> 1.51x / 1.17x the stateful model (bench/ttft.py, one process),
# the compile's probes the same two (a tie goes to the larger first chunk, so 265 tokens still
# run first 128, the chunk and the bulk chunk), the open +26 MB (one more If body). First chunks
# of 32 and 64 as well (24 / 40 / 64 tokens 1.96x / 1.90x / 1.70x -> 1.24x / 1.50x / 1.01x) cost
# the compile 6 s more (six probes where three did) and the open 50 MB: not the default yet.
# At f32 the same first chunks, off the chunk's grid of 32 (a compute-bound Xeon, AVX-512
# without bf16): a prompt of 16 or 100 tokens was one 32-row call over the past or four, at
# 2.3x the stateful model's TTFT; first 16 and 128 bring them to 1.20-1.37x and 1.14-1.29x
# (bench/ttft.py, three runs on a noisy host), the compile +5 s (a probe of 128 tokens).
# At f32 with an f32 cache a bulk chunk of 256, not 512: every If body's outputs are padded to
# the bulk chunk's rows and copied out at each nesting level, so a 16-token call copied 16 MB
# of padding more; bench/compile_ab.py (--prefill-chunk-size 32,256 against 32,512, four
# rounds) gave TTFT 16 / 100 / 512 / 1000 tokens 0.89x / 0.98x / 1.06x / 1.04x, decode 1.00x.
# Bulk and first chunks are dropped where P is not above them.
CPU_CHUNK = {"f32": (32, 256), "bf16": (16, 128), "f16": (16, 128)}
CPU_FIRST = (16, 128)


def resolve_chunk(value, devices=("CPU",), precision: str = "f32") -> int | tuple[int, ...]:
    """--prefill-chunk-size auto: when every device is the CPU, CPU_CHUNK for the blobs'
    arithmetic (`precision`; "auto": what the CPU plugin picks on this host), else 0. A
    LongRoPE model is chunked as any other: its prefill calls read the prompt's last position
    (`kvc.passes.prompt_end`), as the source's one call of the whole prompt does."""
    if value != "auto":
        return value
    if not cpu_only(devices):
        return 0
    return CPU_CHUNK.get(cpu_precision(precision), CPU_CHUNK["f32"])


def resolve_first(value, devices=("CPU",), chunk=0, rows: str = "static", image_rows: int = 0) -> tuple[int, ...]:
    """--prefill-first auto: with a chunked prefill (`chunk`, resolved) when every device is
    the CPU, CPU_FIRST, or with dynamic `rows` one first chunk of the largest chunk's rows
    (the bulk chunk: every If body's outputs are padded to the largest rows, so a larger first
    chunk would pad every call's); else none (the NPU's graphs: no NPU here to measure a
    change on). A model whose image attends itself both ways only in a first call
    (`image_rows`, `source_image_rows`) also gets a first chunk that holds an image and
    IMAGE_LEAD tokens before it (the power of two at or above: Gemma 3's 256 rows, 512), or
    its dynamic one grows to it: with CPU_FIRST alone no Gemma 3 image fit any call."""
    if value != "auto":
        return value
    largest = max(chunk) if isinstance(chunk, tuple) else chunk
    if not (cpu_only(devices) and largest):
        return ()
    first = (largest,) if rows == "dynamic" else CPU_FIRST
    if image_rows:
        holds = 1 << (image_rows + IMAGE_LEAD - 1).bit_length()
        first = (max(largest, holds),) if rows == "dynamic" else tuple(sorted({*first, holds}))
    return first


# The tokens before an image that a first chunk holding it leaves room for (`resolve_first`):
# Gemma 3's chat template puts about 5 (<bos><start_of_turn>user and <start_of_image>); a
# system prompt more.
IMAGE_LEAD = 64


# A first chunk of dynamic rows (--prefill-first-rows auto) at f32: one first-chunk model that
# takes a prompt's first 1 to F tokens unpadded, inside the CPU blob's If chain (its outputs
# padded to static shapes there, export/branches.py), in place of the static first chunks of 16
# and 128. A 100-token prompt's call then computes 100 rows, not 128: through the chain 274 ms
# against the static first-128's 311 (the 250M Llama, f32, one process alternating); a 16-token
# one 97 against 90; the chunk and bulk calls no slower beside a dynamic body (32 rows 144-155
# against 146-163 ms). One If body fewer to compile, probe and import. At bf16 the static first
# chunks stay (measured on an AVX512_BF16 host this one is not).
def resolve_first_rows(value: str, devices=("CPU",), precision: str = "f32", chunk=0, selects: bool = False) -> str:
    """--prefill-first-rows auto: "dynamic" when every device is the CPU, its blobs compute at
    f32 (`cpu_precision`), the prefill is chunked (`chunk`, resolved) and the model does not
    select (a TopK router, `source_selects`), else "static". A device other than the CPU takes
    static shapes only: "dynamic" there is an error.

    Not for a mixture of experts: OpenVINO 2026.4.1's CPU plugin rewrites Qwen3-MoE's batched
    experts in a body of dynamic rows into its internal GatherMatmul, and then cannot import the
    blob it exported ("Cannot create GatherMatmul layer ... from unsupported opset:
    extension"); with static rows the same model compiles, imports and verifies."""
    if value == "auto":
        chunked = max(chunk) if isinstance(chunk, tuple) else chunk
        dynamic = cpu_only(devices) and chunked and cpu_precision(precision) == "f32" and not selects
        return "dynamic" if dynamic else "static"
    if value == "dynamic" and not cpu_only(devices):
        others = ", ".join(d for d in devices if d != "CPU")
        raise UsageError(f"--prefill-first-rows dynamic is for CPU-only compiles: {others} runs static shapes only "
                         f"(REFERENCE.md §4)")
    return value


def cpu_only(devices) -> bool:
    """Whether every device is the CPU: the blobs then need nothing the NPU imposes, so the
    `auto` forms below follow the CPU plugin."""
    return set(devices) <= {"CPU"}


def cpu_bf16(devices, precision: str) -> bool:
    """Whether every device is the CPU and its blobs compute at bf16 (`cpu_precision`)."""
    return cpu_only(devices) and cpu_precision(precision) == "bf16"


def cpu_precision(precision: str) -> str:
    """The CPU blobs' arithmetic: `precision`, or for "auto" what the CPU plugin picks here."""
    if precision == "auto":
        return core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    return precision


# The KV cache `kvc compile` stores by default (--kv-precision auto): f16, the NPU plugin's type;
# when every device is a CPU, the type its blobs compute in (bf16 or f32), which the plugin then
# reads as it is. With an f16 past the CPU converts the whole past on every call: at bf16, a
# generate step of the 250M Llama 29.4 ms (f16, Concat) -> 25.9 (bf16, Concat) -> 24.5 (bf16,
# split), a 64-row prefill chunk 61.0 -> 55.2 ms (bench/attention_forms.py, docs/kv-precision.md).
# At f32 the CPU blob's If chain (export/branches.py) converted every body's past in its outer
# graph whichever body ran: a 16-token prompt's first-chunk call took 98-106 ms through the chain
# with an f16 cache, 84-101 with an f32 one (the model alone: 75-80); end to end, TTFT at 16
# tokens 0.88x, decode 0.99x, the open's peak RSS 1.006x the f16 cache's (bench/compile_ab.py,
# docs/benchmarks.md). An f32 cache at f32 arithmetic is also exact: the compile's checks judge
# the blobs by the exact rules, not by an f16 cache's rounding (docs/verification.md).
DEFAULT_KV = "f16"


def resolve_kv(value: str, devices=("CPU",), precision: str = "f32") -> str:
    """--kv-precision auto: when every device is the CPU, the type its blobs compute in
    (`precision`, "auto" resolved for this host: f32, bf16 or f16), else DEFAULT_KV."""
    if value != "auto":
        return value
    return cpu_precision(precision) if cpu_only(devices) else DEFAULT_KV


def resolve_attention(value: str, devices=("CPU",)) -> str:
    """--attention auto: "fold" when every device is the CPU (a generate step reads the past in
    place instead of through a Concat, group-attention's split_past; a prefill chunk's attention
    is rank 4 with the GQA repeat in its query rows, which the CPU plugin fuses, its fold), else
    "grouped" (the NPU's graphs keep the Concat: no NPU here to measure a change on)."""
    if value != "auto":
        return value
    return "fold" if cpu_only(devices) else "grouped"


def resolve_prefill_mlp(value: str, devices=("CPU",), precision: str = "f32") -> str:
    """--prefill-mlp auto: "rows" when every device is the CPU and its blobs compute at bf16
    (where the CPU plugin fuses gated MLPs into LLMMLP: passes/mlp_rows.py), else "as-is"."""
    if value != "auto":
        return value
    return "rows" if cpu_bf16(devices, precision) else "as-is"


def compile_static(devices=("CPU",), precision: str = "auto", selects: bool = False, image_rows: int = 0,
                   **fields) -> StaticOptions:
    """The StaticOptions `kvc compile` builds for `devices` (CPU blobs at `precision`) and a
    model that `selects` or not (`source_selects`), whose images take `image_rows`
    (`source_image_rows`): the `fields` given, and the prefill chunk,
    KV type, attention and prefill MLP form, unless given, resolved as its `auto`
    (`resolve_chunk`, `resolve_first_rows`, `resolve_first`, `resolve_kv`, `resolve_attention`,
    `resolve_prefill_mlp`). `StaticOptions()` itself keeps the library's plain defaults (no
    chunk, an exact f32 cache, grouped attention, the MLP as exported)."""
    fields["prefill_chunk_size"] = resolve_chunk(fields.get("prefill_chunk_size", "auto"), devices, precision)
    fields["prefill_first_rows"] = resolve_first_rows(fields.get("prefill_first_rows", "auto"), devices, precision,
                                                      fields["prefill_chunk_size"], selects)
    fields["prefill_first"] = resolve_first(fields.get("prefill_first", "auto"), devices, fields["prefill_chunk_size"],
                                            fields["prefill_first_rows"], image_rows)
    fields["kv_precision"] = resolve_kv(fields.get("kv_precision", "auto"), devices, precision)
    fields["attention"] = resolve_attention(fields.get("attention", "auto"), devices)
    fields["prefill_mlp"] = resolve_prefill_mlp(fields.get("prefill_mlp", "auto"), devices, precision)
    return StaticOptions(**fields)


def auto_cache(device: str, precision: str) -> dict:
    """What `kvc compile` builds for `device` with --kv-precision, --attention and --prefill-mlp
    left at auto (CPU blobs at `precision`): the form `kvc plan` measures its costs on."""
    resolved = compile_static((device,), precision)
    return {"kv_precision": resolved.kv_precision, "attention": resolved.attention,
            "prefill_mlp": resolved.prefill_mlp}


def check_kv(value: str, devices) -> None:
    """Refuse a KV type a device cannot take: bf16 for the NPU (NPUW's requests want f16 for a
    bf16 port: "Failed to set tensor ... precision: bf16, since the model input tensor precision
    is: f16")."""
    if value == "bf16" and "NPU" in devices:
        raise UsageError("--kv-precision bf16 cannot be compiled for the NPU: the NPU plugin's requests take f16 or "
                         "f32 KV (NPUW refuses a bf16 tensor on a bf16 port); use f16 (the NPU's type)")


@dataclass(frozen=True)
class CompileOptions:
    static: StaticOptions = StaticOptions()
    devices: tuple[str, ...] = ("CPU",)
    # The CPU blobs' arithmetic: "auto" is what the plugin picks for a user who sets nothing
    # (bf16 where the host has AVX512_BF16 or AMX, else f32); "f32" is exact. The IR check
    # runs on kvc's numpy runtime whatever this is, and blobs are judged by the rule their
    # precision calls for (kvc.runtime.compare). NPU blobs through NPUW's CPU backend stay f32.
    inference_precision: str = "auto"
    verify: bool = True
    verify_tokens: int = 8
    force: bool = False
    dumps: bool = False  # write pass-by-pass dumps into OUT/dumps
    instrumentation: Instrumentation = field(default_factory=Instrumentation)
    # Told each phase as it begins and the probes' generations, for a report
    # (kvc.report.collect.CompileRecorder); with `dumps` it writes what it recorded beside them.
    recorder: object | None = field(default=None, compare=False)
    cache_dir: Path | None = None  # blobs kept across compiles (kvc.export.blob_cache)


def compile_to(model_path: str | Path, out: str | Path, options: CompileOptions = CompileOptions(),
               progress: Callable[[str], None] = lambda message: None) -> dict:
    """Compile `model_path` into the directory `out`; return the manifest. `progress` is told
    each step as a line of text, from a second thread too (the device compiles report from
    the thread that awaits them while the IR is verified)."""
    return _compile(Path(model_path), Path(out), options, progress, None)[0]


def compile_and_open(model_path: str | Path, out: str | Path, options: CompileOptions = CompileOptions(),
                     progress: Callable[[str], None] = lambda message: None, device: str | None = None):
    """`compile_to`, then the compiled pipeline on `device` (default: the first of
    `options.devices`) ready to generate: (manifest, StaticPipeline). It serves the blobs the
    compile's blob check imported and ran, so nothing is imported again: the same pipeline as
    `open_compiled(out, backend)` (OpenVINO CPU for "CPU", the NPU plugin for "NPU"), without
    the open's time (on the 250M Llama about 2.5 s less than `kvc compile` and an open;
    docs/benchmarks.md has the figures). The check then holds that device's prefill blobs
    while it imports its generate blobs, as an open does, and on the CPU sweeps its imports as
    an open does (`check_blobs`): its peak is above `kvc compile`'s (the 250M Llama at f32:
    2691-2776 MB against 2630, NPUW_LLM's compile 2641; unswept, 3745-3807)."""
    device = device or options.devices[0]
    if device not in options.devices:
        raise UsageError(f"cannot open the pipeline on {device}: the compile is for {', '.join(options.devices)}")
    return _compile(Path(model_path), Path(out), options, progress, device)


def _compile(model_path: Path, out: Path, options: CompileOptions, progress, serve: str | None):
    """`compile_to`'s work: the manifest, and the pipeline on the device `serve` (else None)."""
    for device in options.devices:
        device_config(device, for_export=True, precision=options.inference_precision)
    check_kv(options.static.kv_precision, options.devices)
    out = Path(os.path.abspath(out))  # "-o ." has no name to put the work directory beside
    _check_out(model_path, out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _output_error(exc, out, None) from None
    _clean_interrupted(out, progress)
    if out.exists() and not options.force:
        raise UsageError(f"{out} exists; pass --force to replace it")
    try:
        work = temp_dir(out.parent, f".{out.name}.partial-{os.getpid()}-")
    except OSError as exc:
        raise _output_error(exc, out, None) from None
    try:
        with BackgroundHashes() as hashes, DeviceCompiler() as compiler:
            manifest, pipeline = _compile_into(model_path, work, options, progress, hashes, compiler, serve)
        write_bytes_atomic(work / MANIFEST, dumps(manifest).encode())
        _publish(work, out, options.force)
        if pipeline is not None:  # this process goes on, serving: what the compile freed goes back
            trim_heap()
        return manifest, pipeline
    except OSError as exc:
        if exc.errno not in _CANNOT_WRITE:
            raise
        raise _output_error(exc, out, work) from None
    except BaseException:
        if options.dumps and (work / "dumps").is_dir():  # asked for: kept, and said where
            kept = out.with_name(f"{out.name}.failed-dumps")
            shutil.rmtree(kept, ignore_errors=True)
            os.replace(work / "dumps", kept)
            progress(f"dumps of the failed compile: {kept}")
        raise
    finally:
        if work.exists():
            shutil.rmtree(work)


def _check_out(model_path: Path, out: Path) -> None:
    """What `--force` may replace: OUT is replaced whole, and it deleted the model it had just
    compiled (`-o` the model's directory or a parent), so OUT must not be or hold the source,
    nor be a file, nor the working directory or a parent of it (the caller's shell would be
    left in a deleted directory)."""
    source = Path(os.path.realpath(model_path))
    for target in {out, Path(os.path.realpath(out))}:
        if target == source or target in source.parents:
            raise UsageError(f"{out} holds the source model {model_path}: compiling into it would replace the "
                             f"model with its compile; choose another -o")
    if out.is_file():
        raise UsageError(f"{out} is a file: kvc compile writes a directory; choose another -o")
    cwd = Path.cwd()
    if out.exists() and (cwd == Path(os.path.realpath(out)) or Path(os.path.realpath(out)) in cwd.parents):
        raise UsageError(f"{out} is the working directory or holds it: replacing it would leave this shell in a "
                         f"deleted directory; choose another -o")


def _remove(path: Path) -> None:
    """Remove a directory kvc wrote or replaced, or a symlink that stood at OUT (the link, not
    what it points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


_CANNOT_WRITE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}  # (permissions fail at temp_dir)


def _output_error(exc: OSError, out: Path, work: Path | None) -> OutputError:
    """Why OUT cannot be written, with the numbers that say how much room it needs."""
    where = f" ({exc.filename})" if exc.filename else ""
    text = f"cannot write {out}: {exc.strerror or exc}{where}; nothing was published"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        written = sum(p.stat().st_size for p in work.rglob("*") if p.is_file()) if work and work.exists() else 0
        free = shutil.disk_usage(out.parent).free
        text += (f" (this compile had written {written / 2**20:.1f} MiB when it failed; "
                 f"{free / 2**20:.1f} MiB free on that filesystem)")
    return OutputError(text)


def _publish(work: Path, out: Path, force: bool) -> None:
    """Rename the finished directory into place (replacing an old one only at the very end,
    and only with --force: a directory another compile published meanwhile is kept, and this
    one fails; rename(2) refuses to replace a non-empty directory, atomically)."""
    old = None
    if out.exists():
        if not force:
            raise UsageError(f"{out} was created by another process during this compile; it was kept "
                             f"and this compile's output discarded (pass --force to replace it)")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.rename(work, out)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise UsageError(f"{out} was created by another process during this compile; it was kept "
                         f"and this compile's output discarded") from None
    fsync_dir(out.parent)
    if old is not None:
        _remove(old)


_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:partial|old)-(?P<pid>\d+)(?:-.*)?")


def _clean_interrupted(out: Path, progress) -> None:
    """Remove what a compile to `out` that was killed left beside it (its process is gone):
    a partial work directory, or the previous result it was replacing, which is put back when
    `out` itself is missing. Each is said."""
    for path in sorted(out.parent.glob(f".{out.name}.*-*")):
        m = _LEFTOVER.fullmatch(path.name)
        if not m or m["name"] != out.name or _alive(int(m["pid"])):
            continue
        if ".old-" in path.name and not out.exists():
            os.replace(path, out)
            progress(f"restored {out} from {path.name}, left by an interrupted compile (process {m['pid']})")
        else:
            _remove(path)
            progress(f"removed {path.name}, left by an interrupted compile (process {m['pid']})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _compile_into(model_path: Path, work: Path, options: CompileOptions, progress, hashes: BackgroundHashes,
                  compiler: DeviceCompiler, serve: str | None):
    """Build, save, export and check everything into `work`; the manifest, and the pipeline
    over the blobs of the device `serve` as their check imported them (else None). Every file's
    hash is started on `hashes` as soon as the file is final; blobs are compiled by `compiler`."""
    cache = None
    if options.cache_dir is not None:
        try:
            cache = BlobCache(options.cache_dir, progress)
        except OSError as exc:  # a cache the compile cannot use is said, and the compile goes on
            progress(f"blob cache: cannot use {options.cache_dir} ({exc.strerror or exc}); this compile goes on "
                     f"without it")
    progress(f"loading {model_path}")
    sources = source_files(model_path)
    for f in sources:
        hashes.start(f)
    check_side_files(resolve(model_path).root)
    stated = model_max_positions(resolve(model_path).root)
    options = dataclasses.replace(options, static=fit_to_model(options.static, stated,
                                                                model_longrope(resolve(model_path).root)))
    _phase(options, "passes, save the IR", work)
    static, xmls = _build_and_save(model_path, work, options, stated, progress)
    # With a blob cache, the keys need each model's XML and each constant's hash (taken beside
    # the hash of the whole file).
    texts = {name: xml.read_text(encoding="utf-8") for name, xml in xmls.items()} if cache is not None else {}
    ranges = [r for text in texts.values() for r in const_ranges(text)]
    hashes.start(work / WEIGHTS_FILE, ranges)
    for path in xmls.values():
        hashes.start(path)
    models = {name: {"xml": xml.name, "pipeline": static.pipelines[name],
                     "inputs": port_table(static.models[name].inputs),
                     "outputs": port_table(static.models[name].outputs), "blobs": {}}
              for name, xml in xmls.items()}
    vocab = static.models["prefill"].output("logits").get_partial_shape()[-1].get_length()
    from kvc.runtime.generate import far_past_fits
    from kvc.verify.compiled import media_probe, probe_cases, selects, special_ids

    selecting = selects(static.models.values())  # a TopK: reduced arithmetic gets the wider bound
    integer = integer_weights(static.models["prefill"])  # the static models share their weights
    # The in-memory graphs hold the source's weights (memory-mapped, resident after the copy into
    # weights.bin); everything after this reads the written IR, so they go now: each later
    # import maps weights.bin again, and a peak with both would count the weights twice more.
    static.models.clear()
    unread = _check_unread(model_path, work, models) if options.verify else None

    def compile_for(device: str, apart: bool = False) -> None:
        keys = {}
        config = export_config(device, options.inference_precision,
                               lambda: hashes.entry(work / WEIGHTS_FILE)["sha256"], integer)
        if cache is not None:
            digests = hashes.range_digests(work / WEIGHTS_FILE, ranges)
            keys = _blob_keys(texts, digests, device, config)
        for name, blob in _export_blobs(work, xmls, models, device, config, progress, compiler, cache,
                                        keys, apart).items():
            models[name]["blobs"][device] = blob

    def compile_apart(device: str) -> None:
        """Every model of `device` in a blob of its own, in place of its If chains (`ChainImportError`)."""
        chains = {m["blobs"][device]["file"] for m in models.values() if "branches" in m["blobs"][device]}
        for file in chains:
            (work / file).unlink()
        compile_for(device, apart=True)
        for file in sorted({m["blobs"][device]["file"] for m in models.values()}):
            hashes.start(work / file)

    manifest = {
        "format": FORMAT,
        "kvc_version": __version__,
        "kvc_build": kvc_build(),
        "openvino_version": openvino_version(),
        "plan": static.plan.to_dict(),
        "devices": list(options.devices),
        "weights": WEIGHTS_FILE,
        "models": models,  # each model's "blobs" filled in as they are compiled
        "tokenizer": _copy_tokenizer(resolve(model_path).root, work),
    }
    from kvc.runtime.interpreter import EvaluationError

    try:
        root = resolve(model_path).root
        cases = probe_cases(static.plan.lengths, vocab, options.verify_tokens, window=model_window(root),
                            switch=model_longrope(root),
                            specials=special_ids(root, vocab), filled=far_past_fits(static.plan.kv_element_types))
        cases += media_probe(manifest, static.plan.lengths, vocab, options.verify_tokens)
        manifest["verification"], ir_gens = _compile_and_verify(model_path, work, manifest, static, cases, selecting,
                                                                options, progress, compiler, compile_for)
        if unread is not None:
            manifest["verification"].update(unread)
        for device in options.devices:
            for file in sorted({m["blobs"][device]["file"] for m in models.values()}):
                hashes.start(work / file)
        manifest["blob_check"], pipeline = _check_blobs(model_path, work, manifest, cases, ir_gens, selecting,
                                                        options, progress, serve, compile_apart)
    except EvaluationError as exc:  # a probe reached past a position table the model states
        beyond = _beyond_max_positions(stated, options.static)
        if beyond is None:
            raise
        raise EvaluationError(f"{exc}\n{_fit_note(beyond)}") from None
    # (taken last: hashing the source's files overlaps the passes and the compiles)
    manifest["source"] = {"path": str(model_path.absolute()),
                          "sha256": {f.name: hashes.entry(f)["sha256"] for f in sources}}
    if options.recorder is not None:
        options.recorder.finish(work, work / "dumps" if options.dumps else None)
    # Outputs, not diagnostics: dumps (and their timings) are left out.
    files = sorted(p for p in work.rglob("*") if p.is_file() and p.name != MANIFEST and "dumps" not in p.parts)
    manifest["files"] = {p.relative_to(work).as_posix(): hashes.entry(p) for p in files}
    return manifest, pipeline


def _build_and_save(model_path: Path, work: Path, options: CompileOptions, stated: tuple[str, int] | None, progress):
    """The static models, built and written as `.xml` files over one weights.bin."""
    instr = options.instrumentation
    if options.dumps:
        instr = dataclasses.replace(instr, dump_dir=work / "dumps")
    progress("running passes: " + format_pipeline(common_passes(options.static)) + ", then one branch per static model")
    with Bundle(work) as bundle:  # weights copied and graphs written while the passes run
        model = load(model_path, consts_found=bundle.start_weights_file)
        source = resolve(model_path).model
        check_no_nan_weights(model, str(source))
        layout = _require_kv_cache(model, source)
        _require_fed_inputs(model, source, layout)
        _require_integer_inputs(model, source)
        embedder_of(model, str(source))  # takes inputs_embeds: its text embeddings model, checked
        beyond = _beyond_max_positions(stated, options.static)
        if beyond:
            progress(f"warning: {beyond}; positions past it are outside what the model was built for")
        try:
            static = build_static(model, options.static, instr, bundle=bundle)
        except PassFailure as exc:
            if beyond:
                exc.add_context(_fit_note(beyond))
            raise exc.in_file(source) from None
        progress("saving " + ", ".join(static.models) + f" with one shared {WEIGHTS_FILE}")
        xmls = bundle.commit()
    return static, xmls


_MAX_POSITIONS_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "seq_length")


def _model_config(source_dir: Path) -> dict:
    """The model's config.json as a dict, its language model's (`language_config`); {} when
    absent or not an object."""
    try:
        config = jsontext.loads(jsontext.read_text(source_dir / "config.json"))
    except (OSError, ValueError):
        return {}
    return language_config(config) if isinstance(config, dict) else {}


def model_window(source_dir: Path) -> int | None:
    """The sliding window the model's config.json states, for the compile's window probe:
    `sliding_window` (Mistral, Qwen2, Starcoder2, Gemma, Cohere2, GPT-OSS; unless
    `use_sliding_window` is false), or GPT-Neo's `window_size` where its `attention_types`
    name local layers; None when it states none."""
    config = _model_config(source_dir)
    window = config.get("sliding_window")
    if window is None and "local" in json.dumps(config.get("attention_types")):
        window = config.get("window_size")
    if config.get("use_sliding_window") is False or isinstance(window, bool) or not isinstance(window, int):
        return None
    return window if window > 0 else None


def model_longrope(source_dir: Path) -> int | None:
    """LongRoPE's original positions T (Phi-3 and Phi-3.5's long-context models, Phi-4-mini),
    where the model's config.json states rope type longrope (in `rope_scaling` or
    `rope_parameters`): optimum's export takes a call's rotary factors long when its longest
    position reaches T, short below (`kvc.cache.moves.longrope_switch`). For the compile's switch
    probe (`probe_cases`) and `resolve_chunk`; None otherwise."""
    from kvc.cache.moves import longrope_switch

    return longrope_switch(_model_config(source_dir))


# How a TopK is written in each source format: an IR layer's type attribute; an ONNX node's
# op_type (NodeProto field 4, a length-delimited string of 4 bytes).
_TOPK = {"ir": b'type="TopK"', "onnx": b"\x22\x04TopK"}


def source_selects(model_path) -> bool:
    """Whether the source model holds a TopK (a mixture of experts' router), read from its
    file without loading it (`resolve_first_rows` needs it before the compile loads the model):
    a scan of the IR's XML or of the ONNX file, in 1 MiB blocks."""
    files = resolve(model_path)
    return _holds(files.model, _TOPK[files.kind])


def _holds(path: Path, pattern: bytes) -> bool:
    """Whether the file holds `pattern`, read in 1 MiB blocks."""
    tail = b""
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            if pattern in tail + block:
                return True
            tail = block[-len(pattern):]
    return False


def source_image_rows(model_path) -> int:
    """The rows of an image (config.json's `mm_tokens_per_image`, Gemma 3's 256) of a
    vision-language model whose language model reads `token_type_ids` (its image attends
    itself both ways only in a prefill call over no past: `kvc.runtime.embeddings.Media`),
    read without loading the model; 0 for any other."""
    files = resolve(model_path)
    rows = _model_config(files.root).get("mm_tokens_per_image")
    if files.kind != "ir" or not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0:
        return 0
    return rows if _holds(files.model, b'name="token_type_ids"') else 0


def model_max_positions(source_dir: Path) -> tuple[str, int] | None:
    """The maximum positions the model's config.json states (learned position tables and
    precomputed ALiBi or band tables stop there), as (key, value); None when it states none."""
    config = _model_config(source_dir)
    key = next((k for k in _MAX_POSITIONS_KEYS if isinstance(config.get(k), int) and config[k] > 0), None)
    return None if key is None else (key, config[key])


def fit_to_model(options: StaticOptions, stated: tuple[str, int] | None, switch: int | None = None) -> StaticOptions:
    """`options` knowing the model's maximum positions (`model_max_positions`), so that
    default lengths fit them (kvc.plan.plan_lengths), and its LongRoPE switch (`model_longrope`),
    which the plan records for the caches (`StaticOptions.longrope_switch`)."""
    if stated is not None and options.max_positions is None:
        options = dataclasses.replace(options, max_positions=stated[1])
    if switch is not None and options.longrope_switch is None:
        options = dataclasses.replace(options, longrope_switch=switch)
    return options


def _beyond_max_positions(stated: tuple[str, int] | None, options: StaticOptions) -> str | None:
    """When the capacity P + R exceeds the model's stated maximum positions, say so."""
    capacity = options.lengths().capacity
    if stated is None or capacity <= stated[1]:
        return None
    return f"the capacity P + R = {capacity} exceeds the model's {stated[0]} = {stated[1]} (config.json)"


def _fit_note(beyond: str) -> str:
    """What a failure caused by a capacity past the model's positions (`_beyond_max_positions`)
    adds to its message."""
    return f"note: {beyond}; lower --max-prompt-len/--min-response-len to fit"


def _require_kv_cache(model, file: Path):
    """A model without a KV cache is valid but not kvc's to compile: exit 6, naming the file.
    Returns its KV layout."""
    from kvc.errors import InvalidModelError, PassError
    from kvc.ir.kv_discovery import kv_layout

    try:
        return kv_layout(model, str(file))
    except InvalidModelError as exc:
        if exc.code != "no-kv-cache":
            raise
        raise PassError(f"{file}: nothing to compile: {exc.reason} (expected {exc.expected}; found {exc.found})") \
            from None


# Inputs that hold ids, positions or a mask: integers in every optimum-intel export.
INTEGER_INPUTS = ("input_ids", "attention_mask", "position_ids", "beam_idx")
# The inputs besides the KV cache that kvc's pipelines feed (inputs_embeds: through the text
# embeddings model; token_type_ids: 0, text; kvc.runtime.embeddings.token_feed).
FED_INPUTS = (*INTEGER_INPUTS, "inputs_embeds", "token_type_ids")


def _require_fed_inputs(model, file: Path, layout) -> None:
    """Every input must be one kvc feeds (FED_INPUTS, or the past of `layout`, the model's KV
    layout), else exit 3 naming it: Qwen3-VL's language model also takes visual_pos_masks and
    deepstack_visual_embeds, which failed the compile later (a static shape unknown, exit 6),
    and an input of a static shape no feed gives failed at the first probe ("missing input")."""
    from kvc.errors import InvalidModelError

    fed = set(FED_INPUTS) | {t.input_name for t in layout.tensors}
    for port in model.inputs:
        shape = port.get_partial_shape()
        if "position_ids" in port.get_names() and shape.rank.is_static and shape.rank.get_length() == 3 \
                and shape[0].is_dynamic:  # mRoPE's sections must be stated: [3, ?, ?]
            raise InvalidModelError("bad-input", str(file), "3-D position_ids must state their sections",
                                    expected="[3, ?, ?] (mRoPE)", found=str(shape))
        if not port.get_names() & fed:
            raise InvalidModelError(
                "unknown-input", str(file), f"input {port.get_any_name()} is not one kvc can feed",
                expected="input_ids or inputs_embeds, attention_mask, position_ids, token_type_ids, beam_idx "
                         "and the KV cache", found=f"{port.get_any_name()} {port.get_element_type().get_type_name()}"
                                               f"{port.get_partial_shape()}")


def _require_integer_inputs(model, file: Path) -> None:
    """Each of INTEGER_INPUTS the model has must be an integer (exit 3 naming the port): an
    `input_ids` declared f32 compiled, and its bf16 CPU blobs rounded every id above 256."""
    from kvc.errors import InvalidModelError

    for port in model.inputs:
        name = next((n for n in INTEGER_INPUTS if n in port.get_names()), None)
        if name is not None and not port.get_element_type().is_integral():
            raise InvalidModelError("bad-input", str(file), f"input {name} must be an integer tensor",
                                    expected="i64 or i32", found=port.get_element_type().get_type_name())


def _blob_keys(texts: dict[str, str], digests: dict, device: str, config: dict) -> dict[str, str]:
    """The blob cache's key of each model (by its XML text) that can be keyed."""
    embedded_below = SMALL_CONSTANT_BYTES if device == "CPU" else 0
    return {name: blob_key(text, digests, device, config, embedded_below) for name, text in texts.items()
            if keyable(text)}


def _export_blobs(work: Path, xmls: dict[str, Path], models: dict[str, dict], device: str, config: dict,
                  progress, compiler, cache: BlobCache | None, keys: dict[str, str],
                  apart: bool = False) -> dict[str, dict]:
    """Compile each saved model for `device` with `config` (`export_config`; each in a fresh
    process, `DeviceCompiler`) and write its blob, or take it from `cache` when it holds the
    blob of the model's key in `keys`; the manifest entry of each. The groups `branch_groups`
    finds in `models` (their manifest entries) are each compiled as one If chain, one blob for
    all (export/branches.py), unless `apart`."""
    groups = [] if apart else branch_groups({n: models[n] for n in xmls}, device)
    grouped = {name: group for group in groups for name in group}
    units = list(dict.fromkeys(grouped.get(name, (name,)) for name in xmls))
    blobs = {}
    progress(f"compiling {', '.join('+'.join(unit) for unit in units)} for {device}")
    for i, unit in enumerate(units, 1):
        label = "+".join(unit)
        path = work / blob_name(label, device)
        key = group_key(unit, keys)
        entry = cache.get(key, label, path) if key is not None else None
        if entry is not None and not _cached_entry_fits(entry, unit, device, config):
            cache.warn(f"blob cache: the record of {label} in {cache.directory} says other than this compile "
                       f"would; compiling it again")
            entry = None
        if entry is not None:
            progress(f"reused from the blob cache ({i}/{len(units)}): {label} for {device}")
        else:
            branches = {name: xmls[name] for name in unit} if len(unit) > 1 else None
            done = compiler.compile(label, xmls[unit[0]], work / WEIGHTS_FILE, device, config, path, branches)
            entry = {"file": path.name, "bytes": done["bytes"], "compile_config": config,
                     "import_config": done["import_config"], **({"branches": list(unit)} if branches else {})}
            if key is not None:
                cache.put(key, path, entry)
            progress(f"compiled for {device} ({i}/{len(units)}): {label}")
        blobs.update(dict.fromkeys(unit, entry))
    return blobs


def _cached_entry_fits(entry: dict, unit: tuple[str, ...], device: str, config: dict) -> bool:
    """Whether a blob cache record's manifest entry is what compiling `unit` for `device` with
    `config` records (`import_config`): the record is copied into the manifest and its import
    configuration is how the blob is imported and judged, so a record that said bf16 for f32
    blobs, a WEIGHTS_PATH elsewhere or a key of its own was published as it was."""
    expected = {"file", "bytes", "compile_config", "import_config", *(("branches",) if len(unit) > 1 else ())}
    if set(entry) != expected or entry["compile_config"] != config:
        return False
    if len(unit) > 1 and entry["branches"] != list(unit):
        return False
    return entry["import_config"] == import_config(device, config)


def check_side_files(source_dir: Path) -> None:
    """Each JSON file of TOKENIZER_FILES in `source_dir` must be a JSON object, else exit 3
    (bad-config) naming it: kvc reads config.json for the positions and sliding window the
    verification probes, generation_config.json for the EOS that ends `kvc run` and the ids
    every probe feeds, and a truncated one read as absent, silently (no window probe, no EOS).
    The copies in OUT are hashed, so what is checked here is what kvc run reads back."""
    for name in TOKENIZER_FILES:
        path = source_dir / name
        if path.exists() and not path.is_file():  # a FIFO read as absent: no window probe, no EOS
            raise InvalidModelError("bad-config", str(path), "is not a regular file", expected="a regular file",
                                    found="a directory" if path.is_dir() else "a device, FIFO or socket")
        if not name.endswith(".json") or not path.is_file():
            continue
        try:
            data = jsontext.loads(jsontext.read_text(path))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidModelError("bad-config", str(path), f"cannot be read as JSON ({exc})",
                                    expected="a JSON object", found=f"{path.stat().st_size} bytes") from None
        if not isinstance(data, dict):
            raise InvalidModelError("bad-config", str(path), "is not a JSON object", expected="a JSON object",
                                    found=type(data).__name__)


def _copy_tokenizer(source_dir: Path, work: Path) -> list[str]:
    """The tokenizer files of an optimum-intel directory, copied beside the models."""
    copied = []
    for fname in TOKENIZER_FILES:
        if (source_dir / fname).is_file():
            shutil.copyfile(source_dir / fname, work / fname)
            copied.append(fname)
    return copied


def reference_session(model_path: Path, edit=None):
    """The source model on OpenVINO CPU at f32, the compile check's reference (`edit`: a
    function of the ov.Model applied first). The pages its
    compile read of the source's weights file are dropped once it is compiled (export/mapped.py;
    the plugin holds its own copy of most weights and reads the file again where it needs):
    on the 250M Llama the reference then peaks at 1.8 GB, not 2.5, and so does the compile."""
    from kvc.runtime.session import OpenVINOSession

    weights = resolve(model_path).weights
    with pages_released(weights, sweep="none") if weights is not None else contextlib.nullcontext():
        model = load(model_path)
        return OpenVINOSession(model if edit is None else edit(model), "CPU")


# Devices whose compiles run beside the IR's verification: the CPU's compiling process holds
# ~0.7 GB, so both fit under NPUW_LLM's own compile (the 250M Llama: peak 1.84 -> 1.94-2.31 GB,
# NPUW_LLM 2.64). An NPU compile's process holds NPUW's weights bank (2.15 GB): beside the
# verification it peaked at 2.81 GB for 3% less time, so it runs after.
BESIDE_VERIFICATION = ("CPU",)


# How long a failed compile waits for the thread awaiting the device compiles (whose process it
# has killed) before it gives up on it (`_Beside`).
ABANDON_SECONDS = 10.0


class _Beside:
    """`work()` run on a daemon thread from now; `result` returns its result or raises its error.

    A daemon thread, and a bounded wait when the caller has failed: interrupted by Ctrl-C
    during the verification, `kvc compile` hung about one time in ten, the main thread waiting
    for this thread and this thread blocked on the interpreter's import lock (in importlib,
    importing kvc.export.branches), which the interrupt had left held. So the thread imports
    nothing that is not imported before it starts, and a failed compile `join`s it for a
    bounded time: stuck, it is left behind and does not hold the process at exit."""

    def __init__(self, work: Callable[[], object]) -> None:
        self._outcome: dict = {}

        def run() -> None:
            try:
                self._outcome["result"] = work()
            except BaseException as exc:  # raised again in the waiting thread
                self._outcome["error"] = exc

        self._thread = threading.Thread(target=run, name="kvc-device-compile", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for `work` to end, at most `timeout` seconds."""
        self._thread.join(timeout)

    def result(self):
        """Wait for `work` to end; its result, or its error raised."""
        self._thread.join()
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["result"]


def _compile_and_verify(model_path: Path, work: Path, manifest: dict, static, cases, selecting: bool,
                        options: CompileOptions, progress, compiler: DeviceCompiler, compile_for):
    """Compile every device's blobs (`compile_for(device)`) and verify the IR against the source
    on the probe `cases` (unless --no-verify): the verification's result and the IR's
    generations (None, None with --no-verify). Each device compile runs in a process of
    its own (`DeviceCompiler`), half of it on one core (the plugin's transformations), so the
    CPU's compiles are awaited on a thread while kvc's process verifies the IR and both cores
    stay busy (the 250M Llama's `kvc compile`, paired runs against the serial order: medians
    15.8 -> 14.7 s in a quiet phase of the machine, 20.0 -> 16.4 s in a busy one). A failed
    verification stops the compiles at once; a failed compile is raised after a verification
    that passed."""
    beside = [d for d in options.devices if d in BESIDE_VERIFICATION] if options.verify else []
    verification = ir_gens = None
    if beside:
        _phase(options, f"compile for {', '.join(beside)}, meanwhile verify the IR (numpy) against the source", work)
        compiling = _Beside(lambda: [compile_for(device) for device in beside])
        try:
            # Its products share the cores with the compile on a pool that does not spin as
            # OpenBLAS's own threads do (kvc.runtime.ops.products.pooled): computing them in this
            # thread until the compile ended gained 0.9% (the 250M Llama, five alternating rounds).
            verification, ir_gens = _verify_ir(model_path, work, manifest, static, cases, selecting, options,
                                               progress)
            compiling.result()
        except BaseException:
            compiler.close(kill=True)  # its thread's wait for a reply ends
            compiling.join(ABANDON_SECONDS)
            raise
    for device in options.devices:
        if device not in beside:
            _phase(options, f"compile for {device}", work)
            compile_for(device)
    if options.verify and not beside:
        _phase(options, "verify the IR (numpy) against the source", work)
        verification, ir_gens = _verify_ir(model_path, work, manifest, static, cases, selecting, options, progress)
    if options.recorder is not None and ir_gens is not None:  # a phase of its own, after the compiles
        options.recorder.probes(model_path, cases, ir_gens, work)
    return verification, ir_gens


def _check_unread(model_path: Path, work: Path, models: dict) -> dict:
    """What no probe can be trusted to read, in the static IR as written, before the probes run:
    every row of every model's token embedding table and every weight (an expert the router
    never picks on the probes), against the source's, byte for byte (kvc.verify.weights). A
    difference is a VerificationError and nothing is written."""
    from kvc.verify.weights import check_directory

    unread = check_directory(model_path, work, {"weights": WEIGHTS_FILE, "models": models})
    bad = next((c for c in unread.values() if not c["ok"]), None)
    if bad is not None:
        raise VerificationError(f"the compiled pipeline does not reproduce {model_path}: {bad['reason']}; "
                                f"nothing was written (kvc bisect to locate)")
    return unread


def _verify_ir(model_path: Path, work: Path, manifest: dict, static, cases, selecting: bool,
               options: CompileOptions, progress):
    """Nothing is published unless it works: the static IR as written, on kvc's numpy runtime,
    against the source on OpenVINO CPU f32, on the probe `cases`; the verification's result and
    the IR's generations (the blob check's reference)."""
    from kvc.verify.compiled import ir_generations, probe_label, verify_static

    progress("verifying the static pipeline (numpy) against the source model (OpenVINO CPU f32)")
    with products.pooled():  # the same numbers whether a device compile runs beside it or not
        ir_gens = ir_generations(work, manifest, cases, lambda i: progress(f"verifying: probes on kvc's numpy "
                                                                            f"runtime ({i}/{len(cases)})"))
    verification = verify_static(reference_session(model_path), static.plan, cases, ir_gens, selecting)
    if not verification["ok"]:
        bad = next(r for r in verification["results"] if not r["ok"])
        raise VerificationError(
            f"the compiled pipeline does not reproduce {model_path}: {probe_label(bad)}: "
            f"{bad['reason']}; nothing was written (use --no-verify to inspect, kvc bisect to locate)")
    if selecting:  # a mixture of experts: every expert run, its router forced (kvc.verify.experts)
        experts = _verify_experts(model_path, work, manifest, cases, progress)
        if experts is not None:
            verification["experts"] = experts
    return verification, ir_gens


def _verify_experts(model_path: Path, work: Path, manifest: dict, cases, progress) -> dict | None:
    """The probes again with every router forced to the experts each position fixes, on both
    sides (kvc.verify.experts): every expert's wiring run, where the probes' own routing may
    pick some never. None for a model without routers."""
    from kvc.verify.experts import experts_of, force_routers, verify_experts

    found = experts_of(load(model_path))
    if found is None:
        return None
    progress(f"verifying every expert: the probes again, each router forced ({found[0]} experts)")
    with products.pooled():
        result = verify_experts(work, manifest, cases, found, lambda: reference_session(model_path, edit=force_routers),
                                lambda i: progress(f"verifying: forced experts on kvc's numpy runtime "
                                                   f"({i}/{len(cases)})"))
    if not result["ok"]:
        raise VerificationError(f"the compiled pipeline does not reproduce {model_path}: {result['reason']}; "
                                f"nothing was written (use --no-verify to inspect, kvc bisect to locate)")
    return result


def _check_blobs(model_path: Path, work: Path, manifest: dict, cases, ir_gens, selecting: bool,
                 options: CompileOptions, progress, serve: str | None, compile_apart):
    """Every blob imported as `kvc run` imports it and run on the probe `cases`, against the
    IR's generations `ir_gens` (only for finite logits with --no-verify): the rows, and the
    pipeline over the blobs of the device `serve` (else None).

    A chain of prefill models the CPU plugin cannot import back (`ChainImportError`: OpenVINO
    2026.4.1 compiles some mixtures of experts into its internal GatherMatmul, and cannot
    import that op inside an If, though it imports the same models compiled alone) is compiled
    again by `compile_apart`, each model a blob of its own, and checked again: Qwen3-MoE and
    AFMoE exported under transformers 4.57, whose default CPU compile stopped at exit 5. Their
    blobs then hold the weights once each, the price of an import that works."""
    from kvc.export.load import ChainImportError
    from kvc.verify.compiled import check_blobs, npuw_reference, probe_label, quantized_reference

    rows, pipeline = [], None
    quantized = quantized_reference(work, manifest, cases, lambda i: progress(
        f"checking: probes on kvc's numpy runtime over the int8 cache as stored ({i}/{len(cases)})"))
    npuw = npuw_reference(work, manifest, cases, lambda i: progress(
        f"checking: probes on kvc's numpy runtime, weights decompressed as NPUW does ({i}/{len(cases)})"))
    for device in options.devices:
        _phase(options, f"check the {device} blobs", work)
        progress(f"importing and running the {device} blobs")
        def check():
            return check_blobs(work, manifest, device, cases, ir_gens,
                               lambda i, n: progress(f"checking the {device} blobs ({i}/{n})"),
                               selecting=selecting, source=model_path, keep=device == serve,
                               quantized=quantized, npuw=npuw)

        try:
            checked, kept = check()
        except ChainImportError as exc:
            progress(f"the {device} plugin cannot import back the chain of prefill models it compiled "
                     f"({exc.reason}); compiling them apart")
            compile_apart(device)
            checked, kept = check()
        rows += checked
        pipeline = pipeline or kept
        bad = next((r for r in rows if not r["ok"]), None)
        if bad is not None:
            raise VerificationError(
                f"the {device} blobs do not reproduce the static IR: {probe_label(bad)}: "
                f"{bad['reason']}; nothing was written (kvc compile --device CPU --no-verify and "
                f"kvc run --from-ir to compare{_reduced_hint(manifest, device)})")
    return rows, pipeline


def _reduced_hint(manifest: dict, device: str) -> str:
    """For blobs computing at bf16, how to tell arithmetic drift from a fault: the check allows
    what the plugin's own bf16 run of the source drifts (`kvc.verify.peer_drift`, named in the
    reason), and exact blobs drift not at all."""
    from kvc.runtime.compare import dynamic_quantization

    config = (manifest["models"]["prefill"]["blobs"].get(device) or {}).get("import_config", {})
    below = ("compute at bf16" if config.get("INFERENCE_PRECISION_HINT") == "bf16" else
             "quantize activations for their integer weights" if dynamic_quantization(config) else None)
    if below is None:
        return ""
    return (f"; these blobs {below}, which drifts further on some models and long prompts: "
            "--inference-precision f32 compiles exact ones, and a fault fails there too")


def _phase(options: CompileOptions, name: str, work: Path) -> None:
    """Tell the report's recorder, if any, that a phase begins (the previous one ends)."""
    if options.recorder is not None:
        options.recorder.phase(name, work)


def embed_small_constants(model) -> None:
    """Make a weightless blob carry every constant under SMALL_CONSTANT_BYTES (16 KB) itself,
    reading only the real weights from weights.bin at import.

    OpenVINO 2026.4.1's CPU plugin restores weightless constants from WEIGHTS_PATH by their
    recorded offset, size and element type. For i64 constants holding values outside the i32
    range (torch's `x[..., ::2]` exports Slice stops of INT64_MAX, as in GPT-J's and CodeGen's
    interleaved rotary) the restored value differs from the compiled one in static models:
    the blob compiles and exports, then fails at import ("Requested output shape [1,1,4,4,1]
    is incompatible with input shape"); the same stops at INT32_MAX import fine. Without the
    weightless attribute a constant is stored in the blob; for constants this small that
    also makes the blob smaller than the reference to weights.bin would.
    """
    for op in model.get_ops():
        if op.get_type_name() == "Constant" and op.get_byte_size() < SMALL_CONSTANT_BYTES:
            rt = op.get_rt_info()
            for key in [k for k in rt.keys() if k.startswith("WeightlessCacheAttribute")]:
                del rt[key]


def import_config(device: str, config: dict, compiled=None) -> dict:
    """What import needs: a CPU blob forgets its arithmetic, so the precision and dynamic
    quantization the compile chose (asked for, or the plugin's default) are recorded as the
    `compiled` model reports them (without it, as `config` and the plugin's defaults set them:
    what a blob cache record must say, `_cached_entry_fits`); weightless blobs (CPU, and NPU
    through NPUW) need the weights file."""
    if device == "CPU":
        if compiled is not None:
            chosen = {"INFERENCE_PRECISION_HINT": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(),
                      "DYNAMIC_QUANTIZATION_GROUP_SIZE": str(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE"))}
        else:
            chosen = {"INFERENCE_PRECISION_HINT": config.get("INFERENCE_PRECISION_HINT", cpu_precision("auto")),
                      "DYNAMIC_QUANTIZATION_GROUP_SIZE": config.get(
                          "DYNAMIC_QUANTIZATION_GROUP_SIZE", str(core().get_property("CPU", "DYNAMIC_QUANTIZATION_GROUP_SIZE")))}
        return {**config, **chosen, "WEIGHTS_PATH": WEIGHTS_FILE}
    if config.get("NPUW_CWAI") == "YES":
        return {**config, "WEIGHTS_PATH": WEIGHTS_FILE}
    return dict(config)

