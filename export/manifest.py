"""manifest.json: what a compiled directory holds, written last, and checked when read.

It records the kvc and OpenVINO versions, the plan (`kvc.plan.StaticPlan`: options, effective
lengths and KV layout, in its own versioned section), the devices, every model's inputs and outputs (names, element types, shapes) and files, the
source (its absolute path and the sha256 of its files), the size and sha256 of every output
file, and the verification summary. Nothing in it depends on time or on the machine, so
compiling the same input twice in the same place gives the same file.

What a compiled directory says is checked before it is trusted (`check_files`): every file
the manifest names must stay inside the directory and be listed with its size and hash;
sizes are compared on every open (cheap), sha256 on `kvc verify` and `kvc run --check`.
A mismatch is an InvalidModelError (exit 3) naming the file, expected versus found.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
from pathlib import Path

import openvino as ov

from kvc import jsontext
from kvc.errors import DeviceError, InvalidModelError, UsageError
from kvc.ir.validate import check_inside
from kvc.plan import StaticPlan
from kvc.ir.text_embeddings import TEXT_EMBEDDINGS_FILES, TOKEN_EMBEDS
from kvc.ir.text_embeddings import token_input as _token_input

MANIFEST = "manifest.json"
# 2: files hold {"bytes", "sha256"}; the source path is absolute.
# 3: options, lengths and kv are the "plan" section (kvc.plan.StaticPlan.to_dict); "devices".
FORMAT = 3
# Files of an optimum-intel directory that `kvc run --prompt` and openvino.genai use (and the
# text embeddings model of a language model that takes inputs_embeds: runtime/embeddings.py),
# copied beside the models and listed in the manifest's "tokenizer" and "files". kvc reads some
# of them back (tokenizer.json, generation_config.json, config.json, the text embeddings model):
# one in OUT that the manifest does not list is refused (`check_files`), not read.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                   "generation_config.json", "openvino_tokenizer.xml", "openvino_tokenizer.bin",
                   "openvino_detokenizer.xml", "openvino_detokenizer.bin",
                   *TEXT_EMBEDDINGS_FILES)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_ranges(path: Path, ranges, chunk: int = 1 << 22) -> dict[tuple[int, int], str]:
    """sha256 of each (offset, size) range of a file, read in file order."""
    out = {}
    with open(path, "rb") as f:
        for offset, size in sorted(set(ranges)):
            h, left = hashlib.sha256(), size
            f.seek(offset)
            while left:
                block = f.read(min(left, chunk))
                if not block:
                    raise ValueError(f"{path}: range ({offset}, {size}) is past the end of the file")
                h.update(block)
                left -= len(block)
            out[(offset, size)] = h.hexdigest()
    return out


def source_files(path: Path) -> list[Path]:
    """A model's files whose hashes identify it: its .xml/.onnx and its weights, and the text
    embeddings model beside it (the ids' rows of a model that takes inputs_embeds)."""
    from kvc.ir.reader import resolve

    files = resolve(path)
    embeddings = [files.model.parent / name for name in TEXT_EMBEDDINGS_FILES]
    return ([files.model] + ([files.weights] if files.weights is not None and files.weights.exists() else [])
            + [f for f in embeddings if files.kind == "ir" and f.is_file()])


def source_hashes(path: Path) -> dict[str, str]:
    """sha256 of a model's files (its .xml/.onnx and weights) by file name."""
    return {f.name: sha256_file(f) for f in source_files(path)}


def same_source(manifest: dict, path: Path) -> bool:
    """Whether a compiled directory's manifest records the files of the model at `path` (by
    name and sha256, wherever the model now lies)."""
    source = manifest["source"]
    return isinstance(source, dict) and source.get("sha256") == source_hashes(path)


def recorded_source(manifest: dict, directory: str | Path) -> Path:
    """The source model a compiled directory was made from, checked unchanged: missing is a
    UsageError (give --against), changed is an InvalidModelError naming the file."""

    path = Path(manifest["source"]["path"])
    if not path.exists():
        raise UsageError(f"{directory} was compiled from {path}, which no longer exists; "
                         f"give the original model with --against")
    recorded, found = manifest["source"]["sha256"], source_hashes(path)
    for name in sorted(set(recorded) | set(found)):
        if recorded.get(name) != found.get(name):
            raise InvalidModelError("source-changed", str(path / name if path.is_dir() else path.parent / name),
                                    f"the source model changed since {directory} was compiled from it "
                                    f"(give the original with --against, or recompile)",
                                    expected=recorded.get(name, "no such file"), found=found.get(name, "no such file"))
    return path


def openvino_version() -> str:
    return ov.get_version()


# kvc's packages (pyproject.toml's; tests/export/test_compile.py keeps the two the same)
PACKAGES = ("kvc", "kvc.ir", "kvc.passes", "kvc.passes.framework", "kvc.runtime", "kvc.runtime.ops", "kvc.export",
            "kvc.cache", "kvc.verify", "kvc.cli", "kvc.fixtures", "kvc.report")


@functools.cache
def kvc_build() -> str:
    """A digest of kvc's own code (every .py file of its packages, wherever they are installed
    from), recorded in each manifest as "kvc_build": which kvc compiled and verified a
    directory. kvc's version (0.1.0) does not move from one change to the next, and
    `kvc run --compile-from` served a directory whose verification an older kvc had made, with
    whatever checks it had then (`compile_if_needed` refuses one of another build)."""
    digest = hashlib.sha256()
    for name in PACKAGES:
        root = Path(next(iter(importlib.util.find_spec(name).submodule_search_locations)))
        for file in sorted(root.glob("*.py")):
            digest.update(f"{name}/{file.name}\0".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def port_table(ports) -> list[dict]:
    """Ports as a manifest lists them; a dynamic dimension (the rows of a first chunk of
    dynamic rows) is -1."""
    return [{"name": p.get_any_name(), "names": sorted(p.get_names()), "element_type": p.get_element_type().get_type_name(),
             "shape": [d.get_length() if d.is_static else -1 for d in p.get_partial_shape()]} for p in ports]


def dumps(manifest: dict) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise InvalidModelError("no-manifest", str(directory), "not a kvc compiled directory",
                                expected=f"{MANIFEST} written by `kvc compile`", found="no manifest")
    try:
        manifest = jsontext.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidModelError("bad-manifest", str(path), f"manifest is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise InvalidModelError("bad-manifest", str(path), "unknown manifest format (recompile with this kvc)",
                                expected=f"format {FORMAT}", found=f"format {found!r}")
    _check_structure(manifest, path)
    return manifest


def file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


class BackgroundHashes:
    """sha256 of files taken on a background thread while the caller goes on (hashlib and
    file reads release the GIL; a second thread hashes the ranges a blob cache asks for): `kvc compile` starts the source's hashes before loading it and
    each output's as soon as it is final, instead of reading 2 GB at the start and the end
    (1.5 s of a 250M model's 9.7 s compile, on cores the passes and the device compile
    leave idle). A file that changed after its hash started (size, mtime, ctime or inode), or
    asked for ranges its hash did not cover, is hashed again when asked for; a hashing error is raised
    where the result is asked for."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvc-sha256")
        self._ranges_pool = ThreadPoolExecutor(1, thread_name_prefix="kvc-sha256-ranges")
        self._jobs: dict[Path, tuple] = {}
        self._range_jobs: dict[Path, tuple] = {}

    def start(self, path: Path, ranges=()) -> None:
        """Hash `path`; with `ranges`, also each (offset, size) of it, on a second thread (the
        blob cache's keys, `range_digests`: two cores hash the file at once)."""
        stamp = self._stamp(path)
        self._jobs[path] = (stamp, self._pool.submit(sha256_file, path))
        if ranges:
            ranges = tuple(ranges)
            self._range_jobs[path] = (stamp, ranges, self._ranges_pool.submit(sha256_ranges, path, ranges))

    @staticmethod
    def _stamp(path: Path) -> tuple[int, ...]:
        """What changes when a file is rewritten or replaced: a write moves ctime (which no
        utime can set back), a replacement the inode."""
        st = path.stat()
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino

    def entry(self, path: Path) -> dict:
        stamp, job = self._jobs.get(path, (None, None))
        if job is None or stamp != self._stamp(path):
            return file_entry(path)
        return {"bytes": stamp[0], "sha256": job.result()}

    def range_digests(self, path: Path, ranges) -> dict[tuple[int, int], str]:
        stamp, started, job = self._range_jobs.get(path, (None, (), None))
        if job is None or stamp != self._stamp(path) or not set(ranges) <= set(started):
            return sha256_ranges(path, ranges)
        return job.result()

    def __enter__(self) -> BackgroundHashes:
        return self

    def __exit__(self, *exc) -> None:
        """Hashes not begun are dropped (a failed compile does not wait for them)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ranges_pool.shutdown(wait=False, cancel_futures=True)


def _check_structure(manifest: dict, path: Path) -> None:
    """The keys kvc reads, and every file the manifest names listed in `files` with a path
    that stays inside the directory (the copied files too: `_check_copied`)."""
    def bad(reason, expected=None, found=None):
        return InvalidModelError("bad-manifest", str(path), reason, expected=expected, found=found)

    for key in ("files", "models", "weights", "plan", "devices", "source", "openvino_version"):
        if key not in manifest:
            raise bad(f"missing key {key!r}")
    try:
        plan = StaticPlan.from_dict(manifest["plan"])
    except (KeyError, TypeError, ValueError, AttributeError, UsageError) as exc:
        raise bad(f"malformed plan: {exc.__class__.__name__}: {exc}", expected="kvc.plan.StaticPlan.to_dict()") \
            from None
    files = manifest["files"]
    if not isinstance(files, dict) or not isinstance(manifest["models"], dict) or "prefill" not in manifest["models"]:
        raise bad("malformed files or models", expected="objects, with a prefill model")
    def outside(name: str) -> bool:
        rel = Path(name)
        return rel.is_absolute() or ".." in rel.parts or not rel.parts

    for name, entry in files.items():
        if outside(name):
            raise bad(f"file {name!r} is outside the compiled directory", expected="a relative path inside it")
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            raise bad(f"file {name!r} has no size and sha256", expected='{"bytes": int, "sha256": str}',
                      found=repr(entry)[:80])
    source = manifest["source"]
    if not (isinstance(source, dict) and isinstance(source.get("path"), str) and isinstance(source.get("sha256"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in source["sha256"].items())):
        raise bad("malformed source", expected='{"path": str, "sha256": {file: hash}}', found=repr(source)[:80])
    checks = manifest.get("verification")
    if checks is not None and not (isinstance(checks, dict) and isinstance(checks.get("results"), list)
                                   and all(isinstance(r, dict) for r in checks["results"])):
        raise bad("malformed verification", expected='null or {"results": [...], ...}', found=repr(checks)[:80])
    blob_check = manifest.get("blob_check", [])
    if not (isinstance(blob_check, list) and all(isinstance(r, dict) for r in blob_check)):
        raise bad("malformed blob_check", expected="a list of results", found=repr(blob_check)[:80])
    if not isinstance(manifest["weights"], str):
        raise bad("weights is not a file name", expected="a string", found=repr(manifest["weights"])[:80])
    if outside(manifest["weights"]):
        raise bad(f"weights {manifest['weights']!r} is outside the compiled directory",
                  expected="a relative path inside it")
    named = [manifest["weights"]]
    for model_name, model in manifest["models"].items():
        _check_model(model_name, model, bad)
        named.append(model["xml"])
        named += [b["file"] for b in model["blobs"].values()]
        if _token_input({port["name"] for port in model["inputs"]}) == TOKEN_EMBEDS:  # its ids' rows come from it
            named += TEXT_EMBEDDINGS_FILES
        for device, blob in model["blobs"].items():
            weights = blob["import_config"].get("WEIGHTS_PATH", manifest["weights"])
            if weights != manifest["weights"]:  # the blob's weights are the directory's weights file
                raise bad(f"model {model_name!r}'s {device} blob imports its weights from elsewhere",
                          expected=f"WEIGHTS_PATH {manifest['weights']!r}", found=repr(weights)[:80])
    for name in named:
        if name not in files:
            raise bad(f"{name!r} is used but not listed with its hash", expected="every model, blob and weights file "
                      "(and a text embeddings model, for models that take inputs_embeds) in files")
    _check_copied(manifest, files, bad)
    _check_plan_against_ports(manifest, plan, bad)
    shared = [(name, device, blob) for name, model in manifest["models"].items()
              for device, blob in model["blobs"].items() if "branches" in blob]
    for name, device, blob in shared:  # each list well formed, then all of them in agreement
        _check_branch_list(manifest["models"], name, device, blob["branches"], bad)
    for name, device, blob in shared:
        _check_branches(manifest["models"], name, device, blob, bad)


def _check_copied(manifest: dict, files: dict, bad) -> None:
    """The files the compile copied beside the models (`tokenizer`): names of TOKENIZER_FILES,
    each once, and the same names as `files` lists of them. `kvc verify` compared only the
    copies `tokenizer` named: a text embeddings model taken out of it (its hash in `files`
    refreshed) was never compared, and `kvc run --check` ran its changed rows with exit 0."""
    copied = manifest.get("tokenizer")
    if not (isinstance(copied, list) and all(isinstance(n, str) for n in copied) and len(set(copied)) == len(copied)):
        raise bad("malformed tokenizer (the files copied beside the models)", expected="a list of file names, each "
                  "once", found=repr(copied)[:80])
    for name in copied:
        if name not in TOKENIZER_FILES:
            raise bad(f"the copied files (tokenizer) list {name[:80]!r}, which kvc never copies",
                      expected=f"names among {', '.join(TOKENIZER_FILES)}")
    for name in TOKENIZER_FILES:
        if (name in copied) != (name in files):
            where, other = ("tokenizer", "files") if name in copied else ("files", "tokenizer")
            raise bad(f"{name!r} is in the manifest's {where} but not in its {other}",
                      expected="every file copied beside the models in both the copied files (tokenizer) and files, "
                      "with its hash", found=f"{name!r} in {where} alone")


def _check_branch_list(models: dict, name: str, device: str, branches, bad) -> None:
    """An If blob's `branches` (export/branches.py): two models of the manifest or more, each
    once, this one among them."""
    if not (isinstance(branches, list) and len(branches) >= 2 and len(set(map(str, branches))) == len(branches)
            and name in branches and all(isinstance(m, str) and m in models for m in branches)):
        raise bad(f"model {name!r}'s {device} blob has malformed branches",
                  expected="two models of the manifest or more, this one among them", found=repr(branches)[:80])


def _check_branches(models: dict, name: str, device: str, blob: dict, bad) -> None:
    """The models an If blob lists each list the same file and branches for the device, and
    their outputs pad to one table (`padded_outputs`)."""
    branches = blob["branches"]
    for other in (m for m in branches if m != name):
        theirs = models[other]["blobs"].get(device) or {}
        if theirs.get("file") != blob["file"] or theirs.get("branches") != branches:
            raise bad(f"models {name!r} and {other!r} disagree on their shared {device} blob",
                      expected=f"{blob['file']} with branches {branches}",
                      found=f"{theirs.get('file')} with branches {theirs.get('branches')}")
    if padded_outputs([models[name]["outputs"], models[branches[0]]["outputs"]]) is None:
        raise bad(f"model {name!r} shares a {device} blob with {branches[0]!r} but not its outputs",
                  expected=f"{branches[0]!r}'s outputs' names, types and ranks", found=f"{name!r}'s differ")


def padded_outputs(tables: list[list[dict]]) -> list[dict] | None:
    """The outputs (a port table) that port tables pad to: the same names, types and ranks in
    each, every dimension the largest of any (export/branches.py); None when they differ in
    anything but their dimensions."""
    first = tables[0]
    if any(len(t) != len(first) or any((p["name"], p["element_type"], len(p["shape"])) !=
                                       (q["name"], q["element_type"], len(q["shape"])) for p, q in zip(t, first))
           for t in tables):
        return None
    return [{**ports[0], "shape": [max(dims) for dims in zip(*(p["shape"] for p in ports))]} for ports in zip(*tables)]


def shared_with(name: str, blob: dict) -> str:
    """For a summary: " (one blob with <the other models>)" for an If blob, else ""."""
    others = [m for m in blob.get("branches", ()) if m != name]
    return f" (one blob with {', '.join(others)})" if others else ""


def _is_port(p) -> bool:
    return (isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("element_type"), str)
            and isinstance(p.get("shape"), list)
            and all(isinstance(n, int) and not isinstance(n, bool) and -1 <= n < 1 << 40 for n in p["shape"]))


KINDS = ("prefill", "first", "generate")


def model_kind(name) -> tuple[str, int | None] | None:
    """("prefill", None) for "prefill", ("prefill", B) for a bulk chunk's "prefill-B",
    ("first", F) for a first chunk's "first-F", ("generate", T) for "generate-T"; None for
    any other name."""
    if name == "prefill":
        return "prefill", None
    kind, _, size = str(name).partition("-")
    if kind in KINDS and size.isdigit() and size == str(int(size)):
        return kind, int(size)
    return None


def model_order(names) -> list[str]:
    """Model names as compile builds them: prefill, the bulk prefills, the first chunks, then
    the generate variants, each by size."""
    return sorted(names, key=lambda n: (KINDS.index(model_kind(n)[0]), model_kind(n)[1] or 0))


def _check_model(name, model, bad) -> None:
    """One entry of `models`: its name, xml, ports and blobs, with the types kvc reads."""
    if model_kind(name) is None:
        raise bad(f"unknown model name {name!r}", expected="prefill, prefill-<chunk>, first-<chunk> or generate-<size>",
                  found=repr(name)[:80])
    if not isinstance(model, dict) or not isinstance(model.get("xml"), str):
        raise bad(f"model {name!r} is malformed", expected='{"xml": str, "inputs", "outputs", "blobs"}',
                  found=repr(model)[:80])
    for side in ("inputs", "outputs"):
        ports = model.get(side)
        if not isinstance(ports, list) or not all(_is_port(p) for p in ports):
            raise bad(f"model {name!r} has malformed {side}", expected='[{"name": str, "element_type": str, '
                      '"shape": [int, ...]}, ...]', found=repr(ports)[:80])
    blobs = model.get("blobs")
    if not isinstance(blobs, dict) or not all(
            isinstance(b, dict) and isinstance(b.get("file"), str) and isinstance(b.get("import_config"), dict)
            and all(isinstance(k, str) and isinstance(v, (str, int, float)) for k, v in b["import_config"].items())
            for b in blobs.values()):
        raise bad(f"model {name!r} has malformed blobs", expected='{device: {"file": str, "import_config": {..}}}',
                  found=repr(blobs)[:80])


_KV_NAME = re.compile(r"(?:past_key_values|present)\.(\d+)\.(key|value)")


def _check_kv_names(spec, bad) -> None:
    """A KV entry's input and output name its layer and kind (optimum-intel's names, which
    kv-io keeps): swapping two entries' inputs passed every shape check and `kvc run --check`
    wired layer 0's keys into layer 0's values, generating other tokens with exit 0."""
    for port in (spec.input, spec.output):
        named = _KV_NAME.fullmatch(port)
        if named is not None and (int(named[1]), named[2]) != (spec.layer, spec.kind):
            raise bad(f"the plan's KV entry for layer {spec.layer} {spec.kind} is wired to {port!r}",
                      expected=f"past_key_values.{spec.layer}.{spec.kind} -> present.{spec.layer}.{spec.kind}",
                      found=f"{spec.input} -> {spec.output}")


def _check_plan_against_ports(manifest: dict, plan: StaticPlan, bad) -> None:
    """The plan and the models' port tables tell the same story: the generate models are the
    plan's sizes, the bulk prefill models its bulk chunks and the first-chunk models its first
    chunks; every model has logits [.., V] with one V; every KV tensor of the plan is sized for
    the largest variant, is a past input of every generate model (with `size - tokens` rows)
    and of every chunked prefill model (P - its chunk rows), not of a first-chunk model, and a
    present output of every model, in the plan's element type and with the plan's shape off
    the sequence axis. Only a first chunk of dynamic rows has a dynamic (-1) dimension."""
    models, L = manifest["models"], plan.lengths
    kinds = {name: model_kind(name) for name in models}
    sizes = sorted(size for kind, size in kinds.values() if kind == "generate")
    if sizes != sorted(L.sizes):
        raise bad("the generate models are not the plan's sizes", expected=sorted(L.sizes), found=sizes)
    bulk = sorted(size for kind, size in kinds.values() if kind == "prefill" and size is not None)
    if bulk != list(L.bulk):
        raise bad("the bulk prefill models are not the plan's bulk chunks", expected=list(L.bulk), found=bulk)
    first = sorted(size for kind, size in kinds.values() if kind == "first")
    if first != list(L.first):
        raise bad("the first-chunk models are not the plan's first chunks", expected=list(L.first), found=first)
    for spec in plan.kv:
        _check_kv_names(spec, bad)
        if spec.shape[spec.seq_axis] != max(sizes) - L.tokens:
            raise bad(f"the plan's KV {spec.input!r} is not sized for the largest variant",
                      expected=f"{max(sizes) - L.tokens} rows on axis {spec.seq_axis}",
                      found=f"shape {list(spec.shape)}")
    vocab, widths = set(), set()
    for name, model in models.items():
        kind, size = kinds[name]
        inputs = {p["name"]: p for p in model["inputs"]}
        outputs = {p["name"]: p for p in model["outputs"]}
        # The token inputs the pipeline feeds: [1, C or P] ids and [1, P] mask for the prefill,
        # [1, B] ids and [1, P] mask for prefill-B, [1, F] both for first-F ([1, -1]: dynamic
        # rows), [1, G] ids and [1, T] mask for generate-T.
        rows = -1 if L.first_dynamic else size
        dynamic = [p["name"] for p in model["inputs"] + model["outputs"] if -1 in p["shape"]]
        if dynamic and not (kind == "first" and L.first_dynamic):
            raise bad(f"model {name!r} has dynamic ports, which only a first chunk of dynamic rows has",
                      expected="static shapes", found=f"{dynamic[0]} with a -1 dimension")
        step, span = {"prefill": (size or L.chunk or L.prompt, L.prompt), "first": (rows, rows),
                      "generate": (L.tokens, size)}[kind]
        # (A language model that takes inputs_embeds: [1, rows, H] in place of the ids.)
        token, width = _token_input(inputs), []
        if token == TOKEN_EMBEDS:
            width = inputs[TOKEN_EMBEDS]["shape"][2:3] or [-1]
            widths.add(width[0])
        for port, want in ((token, [1, step, *width]), ("attention_mask", [1, span])):
            if port not in inputs or inputs[port]["shape"] != want:
                raise bad(f"model {name!r}'s {port} does not match the plan's lengths", expected=want,
                          found=inputs[port]["shape"] if port in inputs else "no such input")
        logits = outputs.get("logits")
        if logits is None or not logits["shape"] or logits["shape"][-1] < 1:
            raise bad(f"model {name!r} has no logits output [.., V]", found=sorted(outputs))
        vocab.add(logits["shape"][-1])
        for spec in plan.kv:
            wanted = [(outputs, spec.output, "output", step)]  # this step's rows: C, P, B, F or G
            if kind == "generate":
                wanted.append((inputs, spec.input, "input", size - L.tokens))
            elif kind == "first" and spec.input in inputs:
                raise bad(f"first-chunk model {name!r} reads a past", expected="no past input",
                          found=f"input {spec.input!r}")
            elif kind == "prefill" and L.chunk:  # a chunk's past: P - C slots (P - B for prefill-B)
                wanted.append((inputs, spec.input, "input", L.prompt - (size or L.chunk)))
            for ports, port, side, rows in wanted:
                found = ports.get(port)
                if found is None:
                    raise bad(f"the plan's KV {side} {port!r} is not a port of model {name!r}",
                              expected=port, found=sorted(ports))
                shape = found["shape"]
                expect = list(spec.shape)
                if len(shape) == len(expect):
                    expect[spec.seq_axis] = rows if rows is not None else shape[spec.seq_axis]
                if found["element_type"] != spec.element_type or shape != expect:
                    raise bad(f"model {name!r}'s {side} {port!r} does not match the plan's KV layout",
                              expected=f"{spec.element_type} {expect}", found=f"{found['element_type']} {shape}")
    if len(vocab) != 1:
        raise bad("the models disagree on the vocabulary size", expected="one V", found=sorted(vocab))
    if len(widths) > 1 or any(w < 1 for w in widths):
        raise bad(f"the models' {TOKEN_EMBEDS} disagree on the row width", expected="one H >= 1",
                  found=sorted(widths))


def token_input(manifest: dict) -> str:
    """The name of the compiled models' token input: input_ids, or inputs_embeds (a
    vision-language model's language model: kvc.runtime.embeddings)."""
    return _token_input({p["name"] for p in manifest["models"]["prefill"]["inputs"]})


def check_ports(directory, name: str, entry: dict, ports_in, ports_out) -> None:
    """A loaded model (IR or blob) has the ports its manifest entry lists: each listed name
    (a port may carry several tensor names) with its element type and shape, and no others.
    Otherwise the pipeline would feed it buffers of the wrong layout."""
    for side, listed, actual in (("inputs", entry["inputs"], ports_in), ("outputs", entry["outputs"], ports_out)):
        by_name = {n: p for p in actual for n in p.get_names()}
        wrong = []
        for port in listed:
            found = by_name.get(port["name"])
            have = None if found is None else (found.get_element_type().get_type_name(),
                                               [d.get_length() if d.is_static else -1 for d in found.get_partial_shape()])
            if have != (port["element_type"], port["shape"]):
                wrong.append((port["name"], (port["element_type"], port["shape"]), have))
        if wrong or len(listed) != len(actual):
            raise InvalidModelError("ports-differ", str(Path(directory) / MANIFEST),
                                    f"model {name!r}'s {side} differ from what the manifest lists",
                                    expected="; ".join(f"{n} {w}" for n, w, _ in wrong[:3]) or f"{len(listed)} ports",
                                    found="; ".join(f"{n} {h or 'no such port'}" for n, _, h in wrong[:3])
                                    or f"{len(actual)} ports")



def vocab_of(manifest: dict) -> int:
    """The vocabulary size: the last axis of the prefill model's logits."""
    return next(o["shape"][-1] for o in manifest["models"]["prefill"]["outputs"] if o["name"] == "logits")


def plan_of(manifest: dict) -> StaticPlan:
    """The plan of a manifest that `read_manifest` checked."""
    return StaticPlan.from_dict(manifest["plan"])


def check_files(directory: str | Path, manifest: dict, *, sha256: bool = False) -> None:
    """Every listed file present, inside the directory once symlinks are followed (else
    path-escape, as `kvc verify` and every model read refuse it: `kvc run` ran such files when
    their sizes or hashes matched), with its recorded size (and sha256 when asked); and no
    file of TOKENIZER_FILES that the manifest does not list (file-unlisted): kvc reads
    tokenizer.json, generation_config.json and config.json from the directory, and a
    generation_config.json put in a compile of a source that had none changed where `kvc run
    --check` stopped, with exit 0. Refused rather than ignored: every reader of those files
    then reads only what the manifest hashes, without each having to consult it."""
    directory = Path(directory)
    for name in TOKENIZER_FILES:
        path = directory / name
        if name not in manifest["files"] and (path.exists() or path.is_symlink()):
            raise InvalidModelError("file-unlisted", str(path), "a tokenizer, config or text embeddings file the "
                                    "manifest does not list (the compile lists every file it copies), and kvc reads "
                                    "none it cannot check; remove it, or recompile",
                                    expected="no such file", found="a file" if path.is_file() else
                                    "an entry that is not a regular file")
    for name, entry in sorted(manifest["files"].items()):
        path = directory / name
        if not path.is_file():
            raise InvalidModelError("file-missing", str(path), "a file of the compiled directory is missing",
                                    expected=f"{entry['bytes']} bytes", found="no file")
        check_inside(path, directory, str(path), "a file of the compiled directory")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise InvalidModelError("file-changed", str(path), "the file's size differs from the manifest's",
                                    expected=f"{entry['bytes']} bytes", found=f"{size} bytes")
        if sha256:
            digest = sha256_file(path)
            if digest != entry["sha256"]:
                raise InvalidModelError("file-changed", str(path), "the file's sha256 differs from the manifest's",
                                        expected=entry["sha256"], found=digest)


def check_blob_version(manifest: dict, directory: str | Path) -> None:
    """Blobs import only into the OpenVINO build that exported them: say so before trying."""
    made, here = manifest["openvino_version"], openvino_version()
    if made != here:
        raise DeviceError(
            f"{directory}: the blobs were exported by OpenVINO {made}, but this is OpenVINO {here}; "
            f"blobs only import into the exact version that made them. Run from the IR instead "
            f"(kvc run/verify --from-ir), or recompile: kvc compile {manifest['source']['path']} -o {directory} --force")
