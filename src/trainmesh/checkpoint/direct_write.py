"""Writing a byte range of a file around the page cache: the page-aligned middle with ``O_DIRECT``,
the unaligned edges through the page cache.

Why: ``save_pretrained``'s processes write bytes the model already holds in memory, to be fsynced
at once. A buffered write first needs a new page-cache page for every 4 KiB, and on a virtual
machine whose free memory goes back to the host (free page reporting), each such page costs a fault
on the host: measured, 4 processes x 88 MB into fresh page cache took 1.8-2.6 s and 0.7-0.8 s of
CPU, and the same bytes with ``O_DIRECT`` (through an aligned bounce buffer, fsync included)
0.28-0.58 s and 0.08 s of CPU. On any machine it skips a copy that the fsync then writes out anyway.

``O_DIRECT`` wants the memory address, the file offset and the length aligned to the device's block
(4 KiB covers the usual 512 B and 4 KiB). So a run ``[at, at + n)`` is split: the whole pages inside
it go through an aligned bounce buffer with ``O_DIRECT``; the partial pages at its ends, which it may
share with another process's run or the header, go through the page cache. The two never touch the
same page, so the kernel's own coherence (a direct write flushes and drops cached pages of its own
range only) keeps every byte. Where the file system refuses ``O_DIRECT`` (tmpfs, some network and
FUSE file systems: ``EINVAL`` at open or at the first write), everything goes through the page cache.
"""

from __future__ import annotations

import errno
import mmap
import os

PAGE = 4096
BOUNCE = 8 << 20  # bytes per direct write: large enough for the device, small enough to stay resident


def aligned_split(at: int, size: int, page: int = PAGE) -> tuple[int, int]:
    """The whole pages inside ``[at, at + size)``: ``(start, stop)`` file offsets, ``start == stop``
    when there are none. The bytes before ``start`` and from ``stop`` on are the edges."""
    start = -(-at // page) * page
    stop = (at + size) // page * page
    return (start, stop) if start < stop else (at, at)


def bounce_buffer() -> mmap.mmap:
    """A page-aligned buffer (as ``O_DIRECT`` wants the memory) for ``DirectWriter``s to share: one
    per process, not one per file, so a save's memory grows by one buffer (8 MB) whatever its files."""
    return mmap.mmap(-1, BOUNCE)


class DirectWriter:
    """One file, opened twice: a buffered descriptor (header, edges, fallback) and, where the file
    system allows, an ``O_DIRECT`` one for whole pages. ``fd`` is the buffered descriptor. ``bounce``:
    a shared ``bounce_buffer()``, which the caller closes; None: its own, made when first needed."""

    def __init__(self, path: str, bounce: mmap.mmap | None = None):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
        self._direct: int | None = None
        self._bounce, self._owns_bounce = bounce, bounce is None
        if hasattr(os, "O_DIRECT"):
            try:
                self._direct = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:  # the file system refuses it: the page cache for everything
                self._direct = None

    def write(self, data: memoryview, at: int) -> None:
        """``data`` (bytes) at offset ``at``."""
        start, stop = aligned_split(at, len(data)) if self._direct is not None else (at, at)
        _pwrite_all(self.fd, data[: start - at], at)
        if start < stop:
            self._write_direct(data[start - at : stop - at], start)
        _pwrite_all(self.fd, data[stop - at :], stop)

    def _write_direct(self, data: memoryview, at: int) -> None:
        if self._bounce is None:
            self._bounce = bounce_buffer()
        bounce = memoryview(self._bounce)
        try:
            for first in range(0, len(data), BOUNCE):
                chunk = data[first : first + BOUNCE]
                if self._direct is None:  # refused mid-way: the rest through the page cache
                    _pwrite_all(self.fd, chunk, at + first)
                    continue
                bounce[: len(chunk)] = chunk
                try:
                    _pwrite_all(self._direct, bounce[: len(chunk)], at + first)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._close_direct()  # an alignment this device does not take
                    _pwrite_all(self.fd, chunk, at + first)
        finally:
            bounce.release()

    def fsync(self) -> None:
        os.fsync(self.fd)  # the file's data and metadata, whichever descriptor wrote them

    def close(self) -> None:
        self._close_direct()
        if self._bounce is not None and self._owns_bounce:
            self._bounce.close()
        self._bounce = None
        os.close(self.fd)

    def _close_direct(self) -> None:
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    while len(data):  # pwrite may write less than asked (large runs, signals)
        done = os.pwrite(fd, data, at)
        data, at = data[done:], at + done
