"""Open a compiled directory as a StaticPipeline, from its IR or from its blobs.

Backends: ``numpy`` (kvc's interpreter on the IR), ``openvino`` (CPU), ``npu`` (the NPU
plugin: a real NPU when present, else NPUW on its CPU backend). Blobs are used when the
directory has them for the device, unless `from_ir`; they import only into the OpenVINO
version that exported them, which is checked first with an actionable message.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from pathlib import Path

import numpy as np
import openvino as ov

from kvc.errors import DeviceError, UsageError, openvino_reason
from kvc.export.branches import BranchSession, branch_inputs, branch_ports, branch_selects
from kvc.export.compile import device_config
from kvc.export.mapped import pages_released, trim_heap
from kvc.export.manifest import (check_blob_version, check_files, check_ports, model_kind, plan_of, read_manifest,
                                 vocab_of)
from kvc.ir.reader import core, load, map_weights
from kvc.ir.text_embeddings import TOKEN_EMBEDS
from kvc.runtime.embeddings import embedder_beside
from kvc.runtime.session import CPU_EXACTNESS_KEYS, NumpySession, OpenVINOSession, Session, backend_dtype
from kvc.runtime.static_pipeline import StaticPipeline

BACKENDS = ("numpy", "openvino", "npu")
DEVICE_OF_BACKEND = {"openvino": "CPU", "npu": "NPU"}
BACKEND_OF_DEVICE = {device: backend for backend, device in DEVICE_OF_BACKEND.items()}


def blob_backends(manifest: dict) -> tuple[str, ...]:
    """The backend of each device a compiled directory has blobs for, CPU before NPU: what
    `kvc run` serves by default (the first) and `kvc verify` checks beside numpy (all)."""
    blobs = manifest["models"]["prefill"]["blobs"]
    return tuple(BACKEND_OF_DEVICE[d] for d in sorted(blobs) if d in BACKEND_OF_DEVICE)


def _session(directory: Path, manifest: dict, name: str, backend: str, from_ir: bool,
             sweep: str | None = "none", mapped: ov.Tensor | None = None, imports: _Imports | None = None,
             widen: bool = False, edit=None, npuw: bool = False) -> Session:
    """One model's session; `sweep`: how a blob import pages out weights.bin as it reads it
    (`pages_released`; None: as an open, `_Imports.acquire`);
    `edit`: a function of the ov.Model read from its IR, applied before it runs (a blob is not
    edited: an edit asks for the IR);
    `mapped`: weights.bin as `map_weights` mapped it, shared by the models read from their IR;
    `imports`: the blobs this open imported (an If blob, export/branches.py, serves two models)."""
    entry = manifest["models"][name]
    weights = directory / manifest["weights"]
    device = DEVICE_OF_BACKEND.get(backend)
    blob = entry["blobs"].get(device)
    if _from_blob(entry, backend, from_ir):
        if edit is not None:
            raise ValueError(f"model '{name}' is run from its {device} blob, which cannot be edited")
        imports = imports or _Imports(directory, manifest, device)
        compiled = imports.acquire(name, sweep)
        if "branches" in blob:
            names = branch_inputs({m: manifest["models"][m]["inputs"] for m in blob["branches"]})[name]
            session = imports.keep(blob["file"], BranchSession(compiled, device, names,
                                                               branch_selects(blob["branches"])[name],
                                                               {p["name"]: p["shape"] for p in entry["outputs"]}))
        else:
            session = OpenVINOSession(compiled, device)
        session.embed = embedder_beside(directory, name, entry["inputs"])
        # NPUW frees the copies its import made at a compiled model's first inference; they stay
        # in malloc's arenas, counted in RSS, until the heap is trimmed. The 250M Llama's NPU
        # blobs (NPUW on its CPU backend) held 2038 MB after a 7-token prompt, 1282 trimmed (53
        # ms, once); its CPU blobs 1165 -> 1108 MB (5 ms).
        session.after_first_inference = trim_heap
        return session
    model = load(directory / entry["xml"], weights=weights, mapped=mapped)
    check_ports(directory, name, entry, model.inputs, model.outputs)
    if edit is not None:
        model = edit(model)
    session = (NumpySession(model, widen=widen, npuw=npuw) if backend == "numpy" else
               OpenVINOSession(model, device, _ir_config(blob, device)))
    session.weights_mapping = mapped  # the model's constants point into it: it must live as long as they do
    return session


def _from_blob(entry: dict, backend: str, from_ir: bool) -> bool:
    """Whether a model's session on `backend` imports its blob (else it reads its IR)."""
    return backend != "numpy" and not from_ir and DEVICE_OF_BACKEND[backend] in entry["blobs"]


@dataclasses.dataclass
class _Held:
    """An imported blob: the compiled model, how many sessions hold it, and the sessions it
    keeps alive (`_Imports.keep`)."""

    compiled: ov.CompiledModel
    holders: int = 0
    kept: list = dataclasses.field(default_factory=list)


class _Imports:
    """The blobs of one open, each imported once for the sessions over it and checked against
    the manifest's ports (an If blob's against `branch_ports`); `release` drops a blob, and the
    sessions over it that it `keep`s, when no session holds it (`LazySession`)."""

    def __init__(self, directory: Path, manifest: dict, device: str):
        self.directory, self.manifest, self.device = directory, manifest, device
        self._held: dict[str, _Held] = {}  # by file
        self._imported = 0  # imports made (`acquire`)

    def acquire(self, name: str, sweep: str | None) -> ov.CompiledModel:
        """The compiled model of `name`'s blob, imported if no session holds it, swept as `sweep`
        says (`pages_released`); None: as an open sweeps, the first import as `first_sweep`
        says, the others from the start (export/mapped.py), in the order they happen."""
        blob = self.manifest["models"][name]["blobs"][self.device]
        held = self._held.get(blob["file"])
        if held is None:
            if sweep is None:
                sweep = "all" if self._imported else first_sweep(blob.get("import_config", {}))
            self._imported += 1
            held = self._held[blob["file"]] = _Held(self._import(name, blob, sweep))
        held.holders += 1
        return held.compiled

    def keep(self, file: str, session: Session) -> Session:
        """Hold `session` (and its infer request) as long as the blob `file` is held: OpenVINO
        2026.4.1's CPU plugin crashed running one request of an If model after another request
        of it was released (a segfault, or "corrupted double-linked list")."""
        self._held[file].kept.append(session)
        return session

    def release(self, name: str) -> None:
        file = self.manifest["models"][name]["blobs"][self.device]["file"]
        held = self._held[file]
        held.holders -= 1
        if held.holders == 0:
            del self._held[file]

    def _import(self, name: str, blob: dict, sweep: str) -> ov.CompiledModel:
        directory, device = self.directory, self.device
        check_blob_version(self.manifest, directory)
        config = dict(blob["import_config"])
        if "WEIGHTS_PATH" in config:
            config["WEIGHTS_PATH"] = str(directory / config["WEIGHTS_PATH"])
        try:
            with pages_released(directory / self.manifest["weights"], sweep=sweep):
                compiled = _import_core(config).import_model(io.BytesIO((directory / blob["file"]).read_bytes()),
                                                             device, config)
        except RuntimeError as exc:
            raise _import_error(f"cannot import {blob['file']} on {device}: ", openvino_reason(exc), blob,
                                self.manifest["models"]) from None
        if "branches" in blob:
            entries = {m: self.manifest["models"][m] for m in blob["branches"]}
            check_ports(directory, "+".join(blob["branches"]), branch_ports(entries), compiled.inputs, compiled.outputs)
        else:
            check_ports(directory, name, self.manifest["models"][name], compiled.inputs, compiled.outputs)
        return compiled


def _import_error(head: str, reason: str, blob: dict, models: dict) -> DeviceError:
    """The error of a blob the plugin cannot import (`reason`: the plugin's), with what to do
    about a failure kvc knows (`resolve_first_rows`): the CPU plugin 2026.4.1 compiles some
    mixtures of experts into its internal GatherMatmul, then cannot import that blob:
    Qwen3-MoE's over a first chunk of dynamic rows, AFMoE's (experts beside a shared expert) in
    any body of a chain of prefill models (`kvc.export.branches`), though it imports the same
    static models compiled alone. The latter is a `ChainImportError`, which `kvc compile`
    answers by compiling the chain's models apart."""
    message = head + reason
    if "GatherMatmul" not in reason or "unsupported opset" not in reason:
        return DeviceError(message)
    chain = blob.get("branches", ())
    if any(-1 in port["shape"] for m in chain for port in models[m]["inputs"]):
        return DeviceError(message + "; this CPU plugin cannot import the mixture of experts it compiled over a first "
                           "chunk of dynamic rows: compile with --prefill-first-rows static (auto is static for a "
                           "model with a TopK router)")
    if not chain:
        return DeviceError(message)
    return ChainImportError(message + "; this CPU plugin cannot import the mixture of experts it compiled into a "
                            f"chain of prefill models ({' + '.join(chain)}), though it imports them compiled apart: "
                            "kvc compile compiles them apart when it meets this; compile again with this kvc", reason)


class ChainImportError(DeviceError):
    """The CPU plugin cannot import back the If chain of prefill models it compiled
    (`_import_error`; `reason`: the plugin's): `kvc compile` then compiles them apart
    (export/compile.py)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _ir_config(blob: dict | None, device: str) -> dict:
    """How a model runs from its IR on `device`: as its blob runs (the precision its compile
    chose, recorded in the import config), so that a blob and its IR differ only by the blob;
    without a blob, exact."""
    if blob is None:
        return device_config(device, for_export=False)
    return {k: v for k, v in blob["import_config"].items() if k != "WEIGHTS_PATH"}


def _import_core(config: dict):
    """A Core to import a blob with `config`. NPUW on the CPU imports its CPU subgraphs with the
    CPU plugin's defaults, not with the properties passed to import_model (nor with
    DEVICE_PROPERTIES): on a host with bf16 or AMX they would compute in bf16 and quantize
    activations, and the blob would not reproduce its compile. Those imports get a Core of
    their own whose CPU plugin has the properties set (each Core has its own plugins); the
    process-wide Core is left alone, so a later CPU compile at the plugin's defaults still gets
    them."""
    if config.get("NPU_USE_NPUW") == "YES" and config.get("NPUW_DEVICES") == "CPU":
        return _npuw_cpu_core(tuple(sorted((k, config[k]) for k in CPU_EXACTNESS_KEYS if k in config)))
    return core()


@functools.cache
def _npuw_cpu_core(cpu_properties: tuple) -> ov.Core:
    from kvc.ir.custom_ops import register_extensions

    c = ov.Core()
    register_extensions(c)
    c.set_property("CPU", dict(cpu_properties))
    return c


def backend_config(manifest: dict, backend: str, *, from_ir: bool = False) -> dict | None:
    """The OpenVINO configuration `backend` runs the compiled models with (None for numpy):
    the blobs' import configuration, or the device's when compiled from the IR."""
    if backend == "numpy":
        return None
    device = DEVICE_OF_BACKEND[backend]
    blob = manifest["models"]["prefill"]["blobs"].get(device)
    return dict(blob["import_config"]) if blob is not None and not from_ir else _ir_config(blob, device)


def open_compiled(directory: str | Path, backend: str = "numpy", *, from_ir: bool = False,
                  sha256: bool = False) -> StaticPipeline:
    """A StaticPipeline over a compiled directory, after checking every file's size against
    the manifest (and its sha256 when asked: `kvc run --check`, `kvc verify`)."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_files(directory, manifest, sha256=sha256)
    require_blobs(directory, manifest, backend, from_ir)
    return pipeline_from(directory, manifest, backend, from_ir=from_ir)


def require_blobs(directory, manifest: dict, backend: str, from_ir: bool) -> None:
    """A device backend runs its device's blobs: without them (a directory compiled for another
    device) it is a UsageError naming what there is, unless `from_ir` asks for the IR compiled
    on the device (`kvc run --backend openvino` of an NPU-only directory compiled the IR for the
    CPU in silence, and ran what no check had run)."""
    device = DEVICE_OF_BACKEND.get(backend)
    blobs = manifest["models"]["prefill"]["blobs"]
    if device is None or from_ir or device in blobs:
        return
    there = ", ".join(f"{DEVICE_OF_BACKEND[b]} (--backend {b})" for b in blob_backends(manifest))
    raise UsageError(f"{directory} has no {device} blobs, only {there or 'none'}: use that backend, or --from-ir "
                     f"to compile its IR for {device}")


def model_session(directory: str | Path, name: str, backend: str = "numpy") -> Session:
    """One model of a compiled directory (files checked by size) on `backend`, unbound: its
    past inputs are fed, not shared buffers."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_files(directory, manifest)
    if name not in manifest["models"]:
        raise UsageError(f"{directory}: no model {name!r} (models: {', '.join(manifest['models'])})")
    return _session(directory, manifest, name, backend, from_ir=False)


def pipeline_from(directory: Path, manifest: dict, backend: str, *, from_ir: bool = False,
                  lazy: bool = False, widen: bool = False, serves: bool = False, edit=None,
                  npuw: bool = False) -> StaticPipeline:
    """The StaticPipeline a (checked) manifest describes; `kvc compile` also uses it on its
    unpublished output to import and run every blob it wrote. `lazy`: each model is imported
    when first run and can be released (`LazySession`); with `serves`, its imports are paged
    out as an open's are (below: it keeps them to serve, as `compile_and_open` does). `widen`:
    on the numpy backend, f16 and bf16 computed unrounded at f32
    (`kvc.runtime.interpreter.Interpreter`), the cache too. `edit`: applied to every model read
    from its IR (`_session`; the compile's forced routers, kvc.verify.experts). `npuw`: on the
    numpy backend, weight decompression as NPUW computes it (`Interpreter`)."""
    kv_types = {k.element_type for k in plan_of(manifest).kv}
    if backend == "npu" and "bf16" in kv_types:
        raise UsageError(f"{directory} stores its KV cache as bf16 (compiled for CPU at bf16), which the NPU "
                         f"plugin does not take (its requests want f16); compile it again with --kv-precision f16 "
                         f"(or --device CPU,NPU) to run it on the NPU")

    # models read from their IR share one mapping of weights.bin (`map_weights`)
    device = DEVICE_OF_BACKEND.get(backend)
    reads_ir = not all(_from_blob(m, backend, from_ir) for m in manifest["models"].values())
    mapped = map_weights(directory / manifest["weights"]) if reads_ir else None
    imports = _Imports(directory, manifest, device)
    # An eager open of NPU blobs imports each when the pipeline is built, in `order`, running
    # its first inference before the next (`_first_inference`)
    first_runs = not lazy and device == "NPU" and not reads_ir
    lazy = lazy or first_runs
    serves = serves or first_runs

    def session(name: str):
        # Imports are swept as an open sweeps them (`_Imports.acquire`). A lazy open (the
        # compile's blob check) holds the prefill blobs alone, then the generate ones, and is not
        # swept: each swept import would read the file from disk again (the 250M Llama's compile
        # 18.8 -> 16.1 s; its peak 1818 -> 2219 MB, NPUW_LLM's 2641). One that `serves` holds
        # the prefill blobs while it imports the generate ones, as an open does, and is swept as
        # an open is: unswept, the 250M Llama's f32 `compile_and_open` peaked at 3745 MB, the
        # generate import's read of weights.bin (1 GB) beside the If blob that had run every
        # body (1.74 GB).
        sweep = "none" if lazy and not serves else None
        make = functools.partial(_session, directory, manifest, name, backend, from_ir, sweep, mapped, imports,
                                 widen, edit, npuw)
        if lazy:
            ports = manifest["models"][name]["inputs"]
            dtypes = {p["name"]: backend_dtype(p["element_type"], backend) for p in ports}
            imported = _from_blob(manifest["models"][name], backend, from_ir)
            lazy_session = LazySession(make, dtypes, backend,
                                       functools.partial(imports.release, name) if imported else None)
            lazy_session.embed = embedder_beside(directory, name, ports)
            return lazy_session
        return make()

    # Imported in this order: an If blob first (its import reads the weights once per body before
    # it packs: swept from the start, 3.5-4.5 s against 1.0-1.4; swept behind its packing or not
    # at all, no slower itself), then the generate models, the prefill, the bulk and the first chunks.
    kinds = {name: model_kind(name) for name in manifest["models"]}
    rank = {"generate": 0, "prefill": 1, "first": 2}
    order = sorted(kinds, key=lambda n: ("branches" not in manifest["models"][n]["blobs"].get(device, {}),
                                         rank[kinds[n][0]], kinds[n][1] is not None))
    sessions = {name: session(name) for name in order}
    generate = {size: sessions[name] for name, (kind, size) in kinds.items() if kind == "generate"}
    prefill = sessions["prefill"]
    bulk = {size: sessions[name] for name, (kind, size) in kinds.items() if kind == "prefill" and size is not None}
    first = {size: sessions[name] for name, (kind, size) in kinds.items() if kind == "first"}
    pipe = StaticPipeline(prefill, generate, plan_of(manifest), vocab=vocab_of(manifest), bulk=bulk, first=first)
    if first_runs:  # the last import's copies go at the first prompt, with no import after it
        for name in order[:-1]:
            _first_inference(sessions[name], manifest["models"][name]["inputs"])
    return pipe


def _first_inference(session: LazySession, ports: list[dict]) -> None:
    """Import an NPU blob now and run its first inference, bound to the pipeline's cache as
    every later one is: NPUW frees the copies its import made at a compiled model's first
    inference (`trim_heap` then gives them back), and left to the first prompt, the prefill
    blob's import came on top of the generate blobs' copies. An open runs it on every blob but
    the last it imports (the prefill, whose first prompt frees its copies with no import after
    it; run at the open too, its P-row prefill added 1.1 s). The 250M Llama's NPU blobs (NPUW
    on its CPU backend), three alternating rounds of fresh processes, before against after:
    `open_compiled` peaked at 3040-3043 MB against 2027-2031 (NPUW_LLM's compile: 2641), and
    with a 16-token prompt after it 3044-3045 against 2074-2075; it held 2226 MB after that
    prompt against 1255; the open took 1.38-1.45 s against 0.91-0.99, and the prompt 1.65-1.68
    against 1.95-2.06 (the two together 3.06-3.13 against 2.94-2.97).

    The call is a decode step over an empty cache: token 0 in the last row and, where the model
    has a past, its first slot and the last unmasked; every other input 0. It writes nothing:
    the cache is the pipeline's to write from the outputs. Run before the pipeline binds the
    cache (on dense tensors, then ROI ones), NPUW's CPU backend corrupted the heap of the
    llama fixture's open (`free(): invalid pointer`) at its next generate or at exit."""
    feed = {}
    rows = next(p["shape"][1] for p in ports if p["name"] in ("input_ids", TOKEN_EMBEDS))
    for port in ports:
        if session.bound(port["name"]):
            continue
        value = np.zeros(port["shape"], session.input_dtype(port["name"]))
        if port["name"] == "attention_mask":
            value[..., -1] = 1
            if value.shape[-1] > rows:
                value[..., 0] = 1
        feed[port["name"]] = value
    session.infer(feed)


def first_sweep(import_config: dict) -> str:
    """How an open sweeps its first import (`pages_released`): "behind" its packing where the
    blob computes below f32, else "none".

    The first import reads weights.bin whole before it packs (export/mapped.py); the open's
    peak is then the larger of the first import's (the file beside what it has packed) and the
    second's (both packings, swept from the start). Below f32 the packed copy is smaller than
    the file, so the first import sets the peak and the sweep behind its packing lowers it (at
    bf16: 1630 -> 1097 MB). At f32 the packed copy is as large as the file, so the second
    import sets the peak whatever the first does, and a first sweep only pages out what the
    second import then reads from disk again. The 250M Llama's f32 CPU blobs, three rounds of
    fresh processes: opening took 3.4-3.6 s against 4.1-4.6 with the first import swept behind,
    peaking at 2335 MB either way."""
    return "none" if import_config.get("INFERENCE_PRECISION_HINT") == "f32" else "behind"


def serving(pipe: StaticPipeline) -> StaticPipeline:
    """A fresh pipeline (zeroed KV buffers) over the sessions `pipe` runs, a lazy pipeline's
    (`pipeline_from(..., lazy=True)`) unwrapped and each imported now if it was not: what
    `kvc.export.compile.compile_and_open` serves from the blobs its check imported. `pipe` is
    spent (its sessions are bound to the new buffers)."""
    def opened(session):
        return session._opened() if isinstance(session, LazySession) else session

    lengths = pipe.plan.lengths
    bulk = {size: opened(s) for size, s in pipe.prefill_sessions.items() if size != lengths.chunk}
    return StaticPipeline(opened(pipe.prefill), {size: opened(s) for size, s in pipe.generate_sessions.items()},
                          pipe.plan, pipe.pad_token, pipe.vocab, bulk=bulk,
                          first={size: opened(s) for size, s in pipe.first_sessions.items()})


class LazySession:
    """A session imported at its first inference and dropped by `release` (imported again if
    run again); its buffer bindings are kept across. `kvc compile` checks its blobs with these
    so that prefill and generate models need not be in memory together: each import maps the
    weights file and packs the weights anew."""

    def __init__(self, make, input_dtypes: dict[str, np.dtype], backend: str, on_release=None):
        self._make, self._dtypes, self.backend, self._on_release = make, dict(input_dtypes), backend, on_release
        self._session: Session | None = None
        self._bindings: dict[str, tuple] = {}

    @property
    def input_names(self) -> list[str]:
        return list(self._dtypes)

    def has_input(self, name: str) -> bool:
        return name in self._dtypes

    def input_dtype(self, name: str) -> np.dtype:
        return self._dtypes[name]

    def bound(self, name: str) -> bool:
        return name in self._bindings

    def bind(self, name, buffer, rows, axis) -> None:
        self._bindings[name] = (buffer, rows, axis)
        if self._session is not None:
            self._session.bind(name, buffer, rows, axis)

    def _opened(self) -> Session:
        if self._session is None:
            self._session = self._make()
            for name, args in self._bindings.items():
                self._session.bind(name, *args)
        return self._session

    def infer(self, inputs):
        return self._opened().infer(inputs)

    def release(self) -> None:
        if self._session is not None and self._on_release is not None:
            self._on_release()  # the blob goes when no other session holds it (an If blob's other model)
        self._session = None

    def reset(self) -> None:
        self._opened().reset()

    def state(self):
        return self._opened().state()

    def set_state(self, variable_id, value) -> None:
        self._opened().set_state(variable_id, value)
