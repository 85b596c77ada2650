"""Write models atomically and reproducibly.

A failure never leaves a half-written model that looks valid: both files are written under
temporary names in the target directory, fsynced, then renamed over the targets (weights
first, so a visible `.xml` never points at a missing or partial `.bin`). Weights are never
compressed (OpenVINO's `save_model` defaults to fp16 compression, which would change the
numbers kvc promises to keep).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

import openvino as ov

from kvc.errors import OutputError, UsageError


def _umask() -> int:
    """The process's current umask. Linux shows it in /proc/self/status; elsewhere it can only
    be read by setting it and back (not thread-safe, so only there)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_file(directory: Path, prefix: str, suffix: str = ".tmp") -> tuple[int, Path]:
    """A new file beside its target, readable like any file the user creates (mkstemp's are
    0600, which would make a published model unreadable to anyone else)."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, Path(tmp)


def temp_dir(directory: Path, prefix: str) -> Path:
    """A new directory beside its target, with the user's usual permissions (see temp_file)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
    os.chmod(path, 0o777 & ~_umask())
    return path


def fsync_dir(directory: Path) -> None:
    """Make renames in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(target: str | Path, suffix: str = ""):
    """Yield a temporary path beside `target`; on success rename it over `target`.

    On any exception the temporary file is removed and `target` is untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_path = temp_file(target.parent, f".{target.name}.", suffix + ".tmp")
    os.close(fd)
    try:
        yield tmp_path
        _fsync_file(tmp_path)
        os.replace(tmp_path, target)
        fsync_dir(target.parent)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_bytes_atomic(target: str | Path, data: bytes) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def check_writable(target: str | Path, what: str) -> None:
    """Raise the OutputError `write_output` would, before the work that makes `target` (a
    compile with --report published OUT, then failed to write the page: exit 7, though 7
    says nothing was published). A temporary file is made beside `target` and removed; a
    missing parent is not made (`kvc compile -o NEW --report NEW/page.html` made NEW, then
    refused it as an existing OUT): the nearest directory that exists must be writable, and
    `write_output` makes the rest."""
    path, stream = output_path(target, what)
    try:
        if stream:
            if not os.access(path, os.W_OK):
                raise PermissionError(13, "Permission denied")
            return
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise NotADirectoryError(20, f"{parent} is not a directory")
        fd, tmp = temp_file(parent, f".{path.name}.", ".tmp")
        os.close(fd)
        tmp.unlink()
    except OSError as exc:
        raise OutputError(f"cannot write the {what} {target}: {exc.strerror or exc}; nothing was written") from None


def write_output(target: str | Path, data: bytes, what: str) -> None:
    """`write_bytes_atomic` for a file the user named (`what` it is: "goldens", "plan", ...):
    a path that cannot be written is an OutputError (exit 7) naming it, not an internal error.
    What the path names is kept (`output_path`): a symlink's target is replaced, not the link;
    a device or a FIFO (/dev/null, /dev/stdout) is written to, never replaced by a file; a file
    of a compiled directory is refused."""
    path, stream = output_path(target, what)
    try:
        if stream:
            _write_through(path, data)
        else:
            write_bytes_atomic(path, data)
    except OSError as exc:
        raise OutputError(f"cannot write the {what} {target}: {exc.strerror or exc}; nothing was written") from None


# How long a FIFO may wait for a reader (`_write_through`).
FIFO_WAIT_SECONDS = 10.0


def _write_through(path: Path, data: bytes) -> None:
    """Write `data` to a device, FIFO or socket. A FIFO no process reads is ENXIO after
    FIFO_WAIT_SECONDS, not a wait for a reader that may never come (a shell redirect waits; kvc
    hung): it is opened without blocking, again every 50 ms meanwhile (a reader started beside
    kvc may open it a moment late), then written blocking."""
    import time

    deadline = time.monotonic() + FIFO_WAIT_SECONDS
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            if time.monotonic() >= deadline:
                raise OSError(errno.ENXIO, f"no process opened it for reading within {FIFO_WAIT_SECONDS:g} s (a FIFO "
                                           f"is written only while one reads)") from None
            time.sleep(0.05)
    try:
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def output_path(target: str | Path, what: str) -> tuple[Path, bool]:
    """Where a user-named output goes and whether it is written through (True: a device, a
    FIFO or a socket, which an atomic rename would replace by a regular file: as root,
    `--events /dev/null` replaced the system's /dev/null) rather than replaced. A symlink
    resolves to its target; a directory, or a file a compiled directory holds (its manifest,
    or a file the manifest lists: `--events OUT/manifest.json` left OUT unreadable), is an
    OutputError."""
    path = Path(target)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.is_dir():
        raise OutputError(f"cannot write the {what} {target}: it is a directory; nothing was written")
    if path.exists() and not path.is_file():
        return path, True
    owner = _compiled_directory_of(path)
    if owner is not None:
        raise OutputError(f"cannot write the {what} {target}: it is a file of the compiled directory {owner}, which "
                          f"it would break; nothing was written")
    return path, False


def _compiled_directory_of(path: Path) -> Path | None:
    """The compiled directory `path` is a file of (beside a manifest.json that lists it, or the
    manifest itself), else None."""
    from kvc import jsontext

    manifest = path.parent / "manifest.json"
    if not manifest.is_file():
        return None
    if path.name == manifest.name:
        return path.parent
    try:
        files = jsontext.loads(jsontext.read_text(manifest)).get("files", {})
    except (OSError, ValueError, AttributeError):
        return None
    return path.parent if isinstance(files, dict) and path.name in files else None


def save(model: ov.Model, path: str | Path) -> Path:
    """Save `model` as `path` (an `.xml`) and its `.bin`, atomically and without fp16 compression.

    Counter-made friendly names are first replaced by stable ones
    (`canonicalize_friendly_names`), so the bytes do not depend on the writing process."""
    from kvc.ir.naming import canonicalize_friendly_names

    xml = Path(path)
    if xml.suffix != ".xml":
        raise UsageError(f"{xml}: an OpenVINO IR is saved as an .xml file (with its .bin beside it)")
    canonicalize_friendly_names(model)
    xml.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{xml.stem}.", dir=xml.parent))
    try:
        tmp_xml = tmp_dir / xml.name
        ov.save_model(model, str(tmp_xml), compress_to_fp16=False)
        tmp_bin = tmp_xml.with_suffix(".bin")
        for f in (tmp_bin, tmp_xml):
            if f.exists():
                _fsync_file(f)
        if tmp_bin.exists():
            os.replace(tmp_bin, xml.with_suffix(".bin"))
        else:  # a weightless model: a stale .bin from an earlier save must not linger
            xml.with_suffix(".bin").unlink(missing_ok=True)
        os.replace(tmp_xml, xml)
        fsync_dir(xml.parent)
    finally:
        for leftover in tmp_dir.iterdir():
            leftover.unlink()
        tmp_dir.rmdir()
    return xml
