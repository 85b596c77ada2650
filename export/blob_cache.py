"""Blobs kept across compiles (`kvc compile --cache-dir DIR`), as OpenVINO's CACHE_DIR keeps
compiled models (seed 000's model-cache layer): compiling a model again with one more
generate variant, or for one more device, compiles only what is new.

A blob is stored under the key of what determines its bytes (device compiles run in one
fresh process state, `kvc.export.device_compile`, so nothing else does):

* the static model's IR with every Const's offset left out, and per Const its size and the
  sha256 of its bytes in weights.bin; the offset too for a Const the blob reads from
  weights.bin at import (weightless, `embed_small_constants` keeps the smaller ones in the
  blob): adding a variant moves the small constants kvc's passes made for the other
  variants, not the model's weights, so the other models keep their keys;
* the device, the compile configuration, the host's CPU (name and capabilities), the
  OpenVINO version and kvc's version.

An entry is ``<key>.blob`` with ``<key>.json`` (the key's fields, the blob's size and sha256,
what the manifest records for it), both written atomically. Before an entry is used its
record must name the same key and the blob must have its recorded size and sha256; anything
else (a stale, foreign, truncated or corrupted entry, a record that is not JSON) is
recompiled and the entry replaced, with a warning. A reused blob is checked like a new one:
`kvc compile` imports and runs every blob it publishes.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import re
import shutil
from pathlib import Path

from kvc import __version__, jsontext
from kvc.export.manifest import openvino_version, sha256_file
from kvc.ir.writer import write_bytes_atomic

_CONST = re.compile(r'(<layer\b[^>]*\btype="Const"[^>]*>\s*<data\b[^>]*?)\boffset="(\d+)"\s+size="(\d+)"')
FORMAT = 1


def const_ranges(xml_text: str) -> list[tuple[int, int]]:
    """(offset, size) of every Const of an IR's XML in document order (as kvc's bundle writes
    them: `offset` then `size` in the `<data>` right after the layer tag)."""
    return [(int(m.group(2)), int(m.group(3))) for m in _CONST.finditer(xml_text)]


def keyable(xml_text: str) -> bool:
    """Whether every Const layer of the XML was found with its offset and size: a Const the
    pattern missed would be keyed without its bytes, so such a model is never cached."""
    return len(re.findall(r'<layer\b[^>]*\btype="Const"', xml_text)) == len(const_ranges(xml_text))


def host() -> dict:
    """What a blob depends on beyond its configuration: the CPU it was compiled on (OpenVINO's
    own cache keys CPU blobs on FULL_DEVICE_NAME; with the plugin's default precision the
    arithmetic follows the host's instruction set, and NPUW's CPU backend compiles there too)."""
    from kvc.ir.reader import core

    c = core()
    return {"cpu": c.get_property("CPU", "FULL_DEVICE_NAME"),
            "capabilities": sorted(c.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))}


def blob_key(text: str, digests: dict[tuple[int, int], str], device: str, config: dict, embedded_below: int) -> str:
    """The cache key of the model whose XML is `text`, compiled for `device` with `config`
    (see the module docstring)."""
    consts = [(size, digests[(offset, size)], None if size < embedded_below else offset)
              for offset, size in const_ranges(text)]
    record = {"format": FORMAT, "kvc": __version__, "openvino": openvino_version(), "host": host(), "device": device,
              "config": config, "graph": _CONST.sub(r'\1size="\3"', text), "consts": consts}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def group_key(names: tuple[str, ...], keys: dict[str, str]) -> str | None:
    """The key of the blob of `names` (one model, or the If chain over several: export/branches.py)
    from each model's key in `keys`; None when one is not keyed."""
    if not all(name in keys for name in names):
        return None
    if len(names) == 1:
        return keys[names[0]]
    record = {"format": FORMAT, "branches": [[name, keys[name]] for name in names]}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


class BlobCache:
    """A directory of blobs by key; `warn` is told why an entry was not used."""

    def __init__(self, directory: str | Path, warn=lambda message: None) -> None:
        self.directory = Path(directory)
        self.warn = warn
        self.directory.mkdir(parents=True, exist_ok=True)

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.directory / f"{key}.blob", self.directory / f"{key}.json"

    def get(self, key: str, name: str, out: Path) -> dict | None:
        """Copy the blob of `key` to `out` and return what the manifest records for it, or
        None when there is no usable entry (`name`: the model, for the warning). The copy's
        own sha256 is what is compared with the record (an entry replaced meanwhile by
        another compile cannot slip in between a check and the copy)."""
        blob, record = self._paths(key)
        if not record.exists():
            return None
        try:
            meta = jsontext.loads(jsontext.read_text(record))
            ok = isinstance(meta, dict) and meta.get("key") == key and isinstance(meta.get("entry"), dict)
            if ok:  # a regular file of the recorded size first: a link to /dev/zero filled the disk
                mode = os.stat(blob)
                ok = stat.S_ISREG(mode.st_mode) and mode.st_size == meta.get("bytes")
            if ok:
                shutil.copyfile(blob, out)
                ok = out.stat().st_size == meta.get("bytes") and sha256_file(out) == meta.get("sha256")
        except (OSError, ValueError):
            ok = False
        if not ok:
            out.unlink(missing_ok=True)
            self.warn(f"blob cache: the entry for {name} in {self.directory} is stale or damaged ({blob.name}); "
                      f"compiling it again")
            return None
        return {**meta["entry"], "file": out.name, "bytes": meta["bytes"]}

    def put(self, key: str, blob: Path, entry: dict) -> None:
        """Store the compiled `blob` and its manifest `entry` under `key`; a cache that cannot
        be written is said and skipped (the compile goes on)."""
        path, record = self._paths(key)
        try:
            data = blob.read_bytes()
            write_bytes_atomic(path, data)
            meta = {"key": key, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "entry": entry}
            write_bytes_atomic(record, json.dumps(meta, sort_keys=True, indent=1).encode())
        except OSError as exc:
            self.warn(f"blob cache: cannot store {blob.name} in {self.directory} ({exc.strerror or exc}); "
                      f"this compile goes on without it")
