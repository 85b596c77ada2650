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

import hashlib
import json
from pathlib import Path

import openvino as ov

from kvc.errors import DeviceError, InvalidModelError, UsageError
from kvc.plan import StaticPlan

MANIFEST = "manifest.json"
# 2: files hold {"bytes", "sha256"}; the source path is absolute.
# 3: options, lengths and kv are the "plan" section (kvc.plan.StaticPlan.to_dict); "devices".
FORMAT = 3


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def source_hashes(path: Path) -> dict[str, str]:
    """sha256 of a model's files (its .xml/.onnx and weights) by file name."""
    from kvc.ir.reader import resolve

    files = resolve(path)
    out = {files.model.name: sha256_file(files.model)}
    if files.weights is not None and files.weights.exists():
        out[files.weights.name] = sha256_file(files.weights)
    return out


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


def port_table(ports) -> list[dict]:
    return [{"name": p.get_any_name(), "names": sorted(p.get_names()), "element_type": p.get_element_type().get_type_name(),
             "shape": [d.get_length() for d in p.get_partial_shape()]} for p in ports]


def dumps(manifest: dict) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise InvalidModelError("no-manifest", str(directory), "not a kvc compiled directory",
                                expected=f"{MANIFEST} written by `kvc compile`", found="no manifest")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidModelError("bad-manifest", str(path), f"manifest is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise InvalidModelError("bad-manifest", str(path), "unknown manifest format (recompile with this kvc)",
                                expected=f"format {FORMAT}", found=f"format {found!r}")
    _check_structure(manifest, path)
    return manifest


def file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _check_structure(manifest: dict, path: Path) -> None:
    """The keys kvc reads, and every file the manifest names listed in `files` with a path
    that stays inside the directory."""
    def bad(reason, expected=None, found=None):
        return InvalidModelError("bad-manifest", str(path), reason, expected=expected, found=found)

    for key in ("files", "models", "weights", "plan", "devices", "source", "openvino_version"):
        if key not in manifest:
            raise bad(f"missing key {key!r}")
    try:
        StaticPlan.from_dict(manifest["plan"])
    except (KeyError, TypeError, ValueError, AttributeError, UsageError) as exc:
        raise bad(f"malformed plan: {exc.__class__.__name__}: {exc}", expected="kvc.plan.StaticPlan.to_dict()") \
            from None
    files = manifest["files"]
    if not isinstance(files, dict) or not isinstance(manifest["models"], dict) or "prefill" not in manifest["models"]:
        raise bad("malformed files or models", expected="objects, with a prefill model")
    for name, entry in files.items():
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise bad(f"file {name!r} is outside the compiled directory", expected="a relative path inside it")
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            raise bad(f"file {name!r} has no size and sha256", expected='{"bytes": int, "sha256": str}',
                      found=repr(entry)[:80])
    named = [manifest["weights"]]
    for model_name, model in manifest["models"].items():
        if not isinstance(model, dict) or not isinstance(model.get("blobs", {}), dict):
            raise bad(f"model {model_name!r} is malformed")
        named.append(model.get("xml"))
        named += [b.get("file") if isinstance(b, dict) else None for b in model.get("blobs", {}).values()]
    for name in named:
        if name not in files:
            raise bad(f"{name!r} is used but not listed with its hash", expected="every model, blob and weights file "
                      "in files")


def plan_of(manifest: dict) -> StaticPlan:
    """The plan of a manifest that `read_manifest` checked."""
    return StaticPlan.from_dict(manifest["plan"])


def check_files(directory: str | Path, manifest: dict, *, sha256: bool = False) -> None:
    """Every listed file present with its recorded size (and sha256 when asked)."""
    directory = Path(directory)
    for name, entry in sorted(manifest["files"].items()):
        path = directory / name
        if not path.is_file():
            raise InvalidModelError("file-missing", str(path), "a file of the compiled directory is missing",
                                    expected=f"{entry['bytes']} bytes", found="no file")
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
