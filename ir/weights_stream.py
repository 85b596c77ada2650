"""Write a weights file front to back through staging buffers.

Used by `kvc.ir.bundle` on a thread of the compiling process, while the passes run. (A helper
process did this copy, with O_DIRECT writes, until 2026-11-25: an A/B of the default `kvc
compile` found neither faster, 0.970x and 1.001x without them: docs/benchmarks.md.)
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple


class Origin(NamedTuple):
    """Where a constant's bytes live on disk: the mapped file (path, device, inode) and offset."""

    path: str
    device: int
    inode: int
    offset: int


@dataclass
class Segment:
    """A stretch of the weights file: constants back to back, from one source.

    `source` is where to read the whole stretch from (its file); the `pieces` (offset
    within the segment, bytes) are what is written when there is no source or the copy fails."""

    offset: int
    size: int
    source: Origin | None
    pieces: list[tuple[int, object]]  # bytes-like (numpy arrays), None if only the file has them

    def place(self) -> tuple:
        """Where the segment goes and what it holds (the source file by device and inode:
        its path may be spelled differently by /proc/self/maps)."""
        return self.offset, self.size, self.source[1:] if self.source is not None else None


_CHUNK = 32 << 20  # each staging buffer: large enough for the disk, small next to the weights
_FIRST_CHUNK = 8 << 20
_BUFFERS = 3  # two on their way to disk while the third fills
_WRITERS = 2  # a virtual disk takes more with two writes queued: fp32 work 0.93 -> 0.85 s
_SYNC_FILE_RANGE_WRITE = 2


def _libc_sync_file_range():
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        return fn
    except (OSError, AttributeError):  # not Linux
        return None


_sync_file_range = _libc_sync_file_range()


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """os.pwrite until all of `data` is written (it may write less at a time)."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class Stream:
    """The weights file, written front to back through staging buffers: the source file's
    runs are read into a buffer (`preadv`), and each full buffer is written on a thread of its
    own while the next one fills, handed to the disk at once with `sync_file_range`. Segments
    must come in file order."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffers = [memoryview(bytearray(_CHUNK)) for _ in range(_BUFFERS)]
        self.current = 0  # the buffer being filled, `view`
        self.view = self.buffers[0]
        self.base = self.fill = 0  # `view` holds the file's bytes [base, base + fill)
        self.limit = min(_FIRST_CHUNK, _CHUNK)  # when `view` goes to disk: early at first, so the disk starts soon
        self.short = False  # a segment lacked bytes: its file gave less and nothing was in memory
        self._disk = ThreadPoolExecutor(_WRITERS, thread_name_prefix="kvc-disk")
        self._pending: dict[int, Future] = {}  # buffer -> its write in flight

    def reset(self) -> None:
        self.settle()
        self.base = self.fill = 0
        self.limit = min(_FIRST_CHUNK, _CHUNK)
        self.short = False

    def settle(self) -> None:
        """Wait for the writes in flight; re-raise the first error."""
        pending, self._pending = self._pending, {}
        errors = []
        for future in pending.values():
            try:
                future.result()
            except BaseException as exc:  # wait for every write before raising
                errors.append(exc)
        if errors:
            raise errors[0]

    def release(self) -> None:
        """Stop the disk thread (after the write in flight, if any)."""
        self._disk.shutdown(wait=True)

    def write(self, seg: Segment) -> None:
        self._pad_to(seg.offset)
        if seg.source is not None:
            self._put_file(seg.source, seg.size)
        if self.base + self.fill >= seg.offset + seg.size:
            return
        for within, data in seg.pieces:  # what the file did not give (all, without a source)
            if data is None:  # known by its place in the file alone: nothing to fall back on
                self.short = True
                return
            start, view = seg.offset + within, memoryview(data).cast("B")
            done = max(0, self.base + self.fill - start)
            if done < len(view):
                self._pad_to(start + done)
                self._put_memory(view[done:])

    def flush(self) -> None:
        """Write what is buffered."""
        self.settle()
        if self.fill:
            self._write(self.fill)
            self.settle()

    def close(self, size: int) -> None:
        """Write what is buffered, cut the file to `size` bytes and make it durable."""
        self.flush()
        os.ftruncate(self.fd, size)
        os.fsync(self.fd)

    def _pad_to(self, offset: int) -> None:
        gap = offset - (self.base + self.fill)
        if gap < 0:
            raise AssertionError(f"weights: segment at {offset} comes after byte {self.base + self.fill}")
        self._put_memory(memoryview(bytes(gap)))

    def _put_memory(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            n = min(len(data) - done, self.limit - self.fill)
            self.view[self.fill:self.fill + n] = data[done:done + n]
            done += n
            self._advance(n)

    def _put_file(self, source: Origin, size: int) -> None:
        """Read as much of `size` bytes of `source` as it still holds: all of it, or none if the
        file was replaced since it was mapped, or a part if it was cut short."""
        try:
            src = os.open(source.path, os.O_RDONLY)
        except OSError:
            return
        try:
            stat = os.fstat(src)
            if (stat.st_dev, stat.st_ino) != (source.device, source.inode):
                return
            done = 0
            while done < size:
                n = min(size - done, self.limit - self.fill)
                try:
                    got = os.preadv(src, [self.view[self.fill:self.fill + n]], source.offset + done)
                except OSError:
                    return
                if got <= 0:
                    return
                done += got
                self._advance(got)
        finally:
            os.close(src)

    def _advance(self, n: int) -> None:
        self.fill += n
        if self.fill == self.limit:
            self._write(self.limit)
            self.limit = _CHUNK

    def _write(self, length: int) -> None:
        """Send `view[:length]` to disk in the background and go on in the next buffer (once
        its own write, if any, is done)."""
        self._pending[self.current] = self._disk.submit(self._to_disk, self.view, length, self.base)
        self.current = (self.current + 1) % len(self.buffers)
        previous = self._pending.pop(self.current, None)
        if previous is not None:
            previous.result()
        self.view = self.buffers[self.current]
        self.base += length
        self.fill = 0

    def _to_disk(self, view: memoryview, length: int, offset: int) -> None:
        pwrite_all(self.fd, view[:length], offset)
        if _sync_file_range is not None:
            _sync_file_range(self.fd, offset, length, _SYNC_FILE_RANGE_WRITE)
