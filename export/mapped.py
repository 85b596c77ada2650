"""Give back the pages of weights.bin that an OpenVINO import leaves mapped.

Importing a weightless blob maps the weights file (read-only, shared) and the plugin packs
every matrix into memory of its own; the mapping stays for the life of the compiled model
though inference reads the packed copy. Every page of it was read, so each imported model
keeps the whole file resident in the process: a 250M model's prefill and generate blobs held
1876 MB of weights.bin beside their 1474 MB of packed weights (`kvc run` peaked at 3.4 GB
against 1.6 GB for the stateful model).

While an import runs, a thread of kvc's asks the kernel every 50 ms to page out what the import
has read so far of its new mappings (``madvise(MADV_PAGEOUT)``, `sweep="all"`): the plugin reads
each constant to pack it, so the file is never resident whole. Paging out also evicts the
file's pages from the page cache (no other mapping holds them), so a read that follows reads
the file from disk again. Measured on the 250M bench model, alternating fresh processes:
opening peaked at 2473 MB without the sweep (1.57x the stateful model's compile_model: the
second import held all 938 MB of weights.bin beside the first model's packed weights) and
1757 MB with it (1.12x), the same held RSS (1541 MB) and tokens. Its price: 0.45 s more to open
from a warm page cache (1.73-1.86 s against 1.27-1.32), and the file is out of the page cache
afterwards, so the next open reads it from disk (2.4-3.5 s in a row on the VM's 600 MB/s disk;
posix_fadvise WILLNEED does not refill it there). The trade is taken for the memory: a second
copy of the weights file at every open is what runs a small machine out of memory.

An open's first import is swept behind its packing (`sweep="behind"`) where its blob computes
below f32; at f32 it is not swept (`kvc.export.load.first_sweep` says why). OpenVINO 2026.4.1's CPU
plugin first scans every f32 constant of every body of the model (for subnormals, and at bf16
for values a bf16 cannot hold: `Input::cloneBlobIfRequired`), reading the whole file before it
packs anything, then packs the constants in graph order, which is the file's order (kvc writes
weights.bin in first-use order, ir/bundle.py). Paged out from the start, the first import would
read the file from disk once per body's scan and again to pack (the bench model's If blob of
four bodies: 3.5-4.5 s against 1.0-1.4); never paged out, the whole file stays resident until
the packing ends (the open's peak: 1630 MB, 1.56x the stateful model's compile_model). So the
sweep waits for the packing and then pages out the first G - BEHIND_MARGIN bytes of each new
mapping, G being how much the process's anonymous memory has grown since the import began: a
packed byte costs at least one anonymous byte at f32 and half a byte at bf16 (the packed copy),
so the page-out stays behind the packing and the import reads nothing from disk again; the
margin absorbs the import's other allocations. The pages it paged out are out of the page
cache, so the next import reads them from disk. Measured on the bench model (the four-body If
blob, then the generate blob swept from the start), alternating fresh processes: the If
import alone peaked at 1097 MB against 1632; the open at 1182-1219 MB against 1630, in
2.84-3.39 s against 2.38-2.85, the same held RSS and tokens. Were the packing order or the
estimate wrong, pages would be read from disk again or stay resident longer: time or memory,
never data. Not for `kvc compile`'s blob check, which imports lazily (one prefill blob and the
If blob at most together, then the generate blobs) and stays below NPUW_LLM's compile without
it (export/load.py, `pipeline_from`).

MADV_PAGEOUT never loses data, whatever the range holds by the time the call lands: clean file
pages are dropped and read again from the file when touched, dirty or anonymous pages are written
to swap or left where they are. So the sweep needs no guarantee that the mapping is still the
plugin's (the import may unmap it on failure, and memory mapped at the same address would only
be paged out); pages another mapping also maps are skipped by the kernel.

After each import kvc asks the kernel to drop the new mappings' remaining pages from the process
(``madvise(MADV_DONTNEED)``). The rules that make this safe:

* only mappings that appeared during the import (the numpy runtime's own mapping of the same
  file is left alone: it reads it every step), found in /proc/self/maps by path or by
  device and inode;
* only read-only *shared* file mappings: such a mapping holds no private copy of any page, so
  dropping pages loses nothing. The file's pages stay in the page cache, and a page touched
  again (the embedding table, which Gather reads in place) is faulted back in with the same
  content;
* nothing of kvc's runs between reading the maps and the call: the import (or the compile
  check's reference compile) has returned and owns its mapping until the compiled model is
  released, and the sweep thread has been joined.
  (Another thread of the process that unmapped that range and mapped anonymous memory at the
  same address in that instant would lose its pages: kvc opens a directory on one thread.)

Where this is not Linux, or the file is not found mapped, nothing is done.

A device compile reads the weights over a mapping kvc made and holds (`HeldPages`): there the
sweep drops pages with MADV_DONTNEED while the compile runs, which keeps them in the page cache
(nothing reads the file from disk again), because only kvc can unmap that range. The rules are
in `HeldPages`' docstring.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from pathlib import Path

_MADV_DONTNEED = 4
_PROT_READ = 1
_MADV_PAGEOUT = 21  # Linux 5.4; an older kernel answers EINVAL and the sweep does nothing
SWEEP_SECONDS = 0.05
BEHIND_MARGIN = 64 << 20  # bytes the "behind" sweep keeps between its page-out and the packing
SWEEPS = ("all", "behind", "none")


def _libc(name: str, *argtypes):
    """The C library's function `name`, taking `argtypes`; None where there is none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
        fn.argtypes = argtypes
        return fn
    except (OSError, AttributeError):  # not Linux, or not glibc
        return None


_madvise = _libc("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_mprotect = _libc("mprotect", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_malloc_trim = _libc("malloc_trim", ctypes.c_size_t)


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim(0)``; nothing
    where there is no glibc). Memory that OpenVINO and numpy free stays in malloc's arenas,
    counted in the process's RSS, until the heap is trimmed: after `compile_and_open` on the
    250M Llama the process held 1.45 GB of it with the NPU's pipeline (NPUW frees its
    import's copies at the first inference), 77 MB with the CPU's. An open trims after each
    imported model's first inference (kvc.export.load)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _mappings(path: str | Path) -> list[tuple[int, int, str]]:
    """The (start, end, permissions) of each range where this process maps `path` (found by
    path or by device and inode), from /proc/self/maps."""
    path = Path(path)
    try:
        st, real = path.stat(), os.path.realpath(path)
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        major, minor = (int(x, 16) for x in parts[3].split(":"))
        if parts[5].strip() != real and (int(parts[4]), os.makedev(major, minor)) != (st.st_ino, st.st_dev):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        found.append((start, end, parts[1]))
    return found


def shared_readonly_mappings(path: str | Path) -> set[tuple[int, int]]:
    """The (start, end) address ranges where this process maps `path` read-only and shared."""
    return {(start, end) for start, end, perms in _mappings(path) if perms[:2] == "r-" and perms[3] == "s"}


def status_bytes(field: str) -> int:
    """A size this process's /proc/self/status gives in kB (VmRSS, RssAnon), in bytes; 0 where
    /proc says nothing."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) << 10 for line in f if line.startswith(f"{field}:")), 0)
    except OSError:
        return 0


@contextlib.contextmanager
def pages_released(path: str | Path, *, sweep: str = "all"):
    """Run the block (an import that maps `path`), paging out, as `sweep` says, what it reads of
    the new read-only shared mappings of `path`: "all" of it as it goes, "behind" only what its
    packing has passed, "none"; then drop the pages they still hold. The rules are in the
    module's docstring."""
    if sweep not in SWEEPS:
        raise ValueError(f"sweep must be one of {SWEEPS}, not {sweep!r}")
    before = shared_readonly_mappings(path) if _madvise is not None else None
    if before is None:
        yield
        return
    done, grown_from, page = threading.Event(), status_bytes("RssAnon"), os.sysconf("SC_PAGESIZE")

    def page_out() -> None:
        while not done.wait(SWEEP_SECONDS):
            behind = (status_bytes("RssAnon") - grown_from - BEHIND_MARGIN) // page * page if sweep == "behind" else None
            if behind is not None and behind <= 0:
                continue
            for start, end in shared_readonly_mappings(path) - before:
                _madvise(start, end - start if behind is None else min(behind, end - start), _MADV_PAGEOUT)

    sweeper = threading.Thread(target=page_out, name="kvc-pageout", daemon=True) if sweep != "none" else None
    if sweeper is not None:
        sweeper.start()
    try:
        yield
    finally:
        done.set()
        if sweeper is not None:
            sweeper.join()
    for start, end in sorted(shared_readonly_mappings(path) - before):
        _madvise(start, end - start, _MADV_DONTNEED)


class HeldPages:
    """Give back, while a device compile runs, the pages of weights.bin it has read over a
    mapping kvc holds (`ir.reader.map_weights`, the models' constants loaded over it).

    OpenVINO reads every weight to compile (the CPU plugin packs them; NPUW copies them into
    its weights bank, on a thread of its own after compile_model returns), so without this the
    whole file stays resident in the compiling process beside what it made of it: the NPU
    compile of the 250M bench model peaked at 3065 MB (1006 of them weights.bin), above
    NPUW_LLM's compile of the same model. Used as a context manager, a thread of kvc's drops
    the pages every SWEEP_SECONDS (``madvise(MADV_DONTNEED)``) and once more at exit.

    The rules that make DONTNEED safe here, unlike under an import (module docstring):

    * the range is kvc's own mapping, which the caller holds for the whole block, so nothing
      can unmap it and map other memory there while the sweep runs;
    * it is made read-only first (``mprotect``): map_weights maps copy-on-write (OpenVINO
      shares only a writable buffer), and a page written in it would be private and lost by
      DONTNEED. Read-only, no page can be written (a write faults), so every page is the
      file's: dropped, it stays in the page cache and is faulted back with the same bytes.

    Nothing is dropped unless the tensor's memory is found in /proc/self/maps as exactly a
    private mapping of `path` (not a copy OpenVINO made) and made read-only (Linux only).
    `until_idle` lets NPUW's bank thread finish with the pages being dropped before
    export_model, which waits for it holding the GIL (so no sweep could run)."""

    IDLE_WINDOW = 0.025  # seconds; idle when the other threads used under a tenth of a core
    IDLE_LIMIT = 120.0

    def __init__(self, mapped, path: str | Path) -> None:
        self._range = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if mapped is None or _madvise is None or _mprotect is None:
            return
        address, size = mapped.data.ctypes.data, mapped.data.nbytes
        page = os.sysconf("SC_PAGESIZE")
        length = -(-size // page) * page
        private = any(start == address and end == address + length and perms[3] == "p"
                      for start, end, perms in _mappings(path))
        if private and size > 0 and _mprotect(address, length, _PROT_READ) == 0:
            self._range = (address, length)

    def drop(self) -> None:
        if self._range is not None:
            _madvise(self._range[0], self._range[1], _MADV_DONTNEED)

    def until_idle(self) -> None:
        """Return once this process's other threads have used under a tenth of a core for
        IDLE_WINDOW (or after IDLE_LIMIT), dropping pages meanwhile. Only memory rides on it:
        an early return leaves the rest of the work to export_model, which waits for it."""
        if self._range is None:
            return
        import resource

        def others() -> float:
            own, mine = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD)
            return own.ru_utime + own.ru_stime - mine.ru_utime - mine.ru_stime

        started, used = time.monotonic(), others()
        while time.monotonic() - started < self.IDLE_LIMIT:
            time.sleep(self.IDLE_WINDOW)
            self.drop()
            now = others()
            if now - used < self.IDLE_WINDOW / 10:
                return
            used = now

    def _sweep(self) -> None:
        while not self._done.wait(SWEEP_SECONDS):
            self.drop()

    def __enter__(self) -> HeldPages:
        if self._range is not None:
            self._thread = threading.Thread(target=self._sweep, name="kvc-drop-pages", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        self.drop()
