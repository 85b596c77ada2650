"""Give back the pages of weights.bin that an OpenVINO import leaves mapped.

Importing a weightless blob maps the weights file (read-only, shared) and the plugin packs
every matrix into memory of its own; the mapping stays for the life of the compiled model
though inference reads the packed copy. Every page of it was read, so each imported model
keeps the whole file resident in the process: a 250M model's prefill and generate blobs held
1876 MB of weights.bin beside their 1474 MB of packed weights (`kvc run` peaked at 3.4 GB
against 1.6 GB for the stateful model).

After each import kvc asks the kernel to drop the new mappings' pages from the process
(``madvise(MADV_DONTNEED)``). The rules that make this safe:

* only mappings that appeared during the import (the numpy runtime's own mapping of the same
  file is left alone: it reads it every step), found in /proc/self/maps by path or by
  device and inode;
* only read-only *shared* file mappings: such a mapping holds no private copy of any page, so
  dropping pages loses nothing. The file's pages stay in the page cache, and a page touched
  again (the embedding table, which Gather reads in place) is faulted back in with the same
  content;
* nothing of kvc's runs between reading the maps and the call: the import has returned and
  owns its mapping until the compiled model is released. (Another thread of the process that
  unmapped that range and mapped anonymous memory at the same address in that instant would
  lose its pages: kvc opens a directory on one thread and starts none.)

Where this is not Linux, or the file is not found mapped, nothing is done.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_MADV_DONTNEED = 4


def _libc_madvise():
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return fn
    except (OSError, AttributeError):  # not Linux
        return None


_madvise = _libc_madvise()


def shared_readonly_mappings(path: str | Path) -> set[tuple[int, int]]:
    """The (start, end) address ranges where this process maps `path` read-only and shared."""
    path = Path(path)
    try:
        st, real = path.stat(), os.path.realpath(path)
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    ranges = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[1][:2] != "r-" or parts[1][3] != "s":
            continue
        major, minor = (int(x, 16) for x in parts[3].split(":"))
        if parts[5].strip() != real and (int(parts[4]), os.makedev(major, minor)) != (st.st_ino, st.st_dev):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        ranges.add((start, end))
    return ranges


@contextlib.contextmanager
def pages_released(path: str | Path):
    """Run the block (an import that maps `path`), then drop the pages of the read-only shared
    mappings of `path` that it left: the rules are in the module's docstring."""
    before = shared_readonly_mappings(path) if _madvise is not None else None
    yield
    if before is None:
        return
    for start, end in sorted(shared_readonly_mappings(path) - before):
        _madvise(start, end - start, _MADV_DONTNEED)
