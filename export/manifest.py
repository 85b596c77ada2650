"""manifest.json: what a compiled directory holds, written last.

It records the kvc and OpenVINO versions, the options and the effective lengths, the KV
layout, every model's inputs and outputs (names, element types, shapes) and files, sha256 of
the input files and of every output file, and the verification summary. Nothing in it
depends on time or on the machine, so compiling the same input twice gives the same file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import openvino as ov

from kvc.errors import DeviceError, InvalidModelError

MANIFEST = "manifest.json"
FORMAT = 1


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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
    if manifest.get("format") != FORMAT:
        raise InvalidModelError("bad-manifest", str(path), "unknown manifest format",
                                expected=f"format {FORMAT}", found=f"format {manifest.get('format')!r}")
    return manifest


def check_blob_version(manifest: dict, directory: str | Path) -> None:
    """Blobs import only into the OpenVINO build that exported them: say so before trying."""
    made, here = manifest["openvino_version"], openvino_version()
    if made != here:
        raise DeviceError(
            f"{directory}: the blobs were exported by OpenVINO {made}, but this is OpenVINO {here}; "
            f"blobs only import into the exact version that made them. Run from the IR instead "
            f"(kvc run/verify --from-ir), or recompile: kvc compile {manifest['source']['path']} -o {directory} --force")
