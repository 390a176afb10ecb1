"""Durability primitives: a write-ahead log of opaque records and atomic snapshots.

Log file format: a sequence of frames ``u32 length | u32 crc32 | record`` (little endian; the
crc covers the length bytes and the record, so a corrupted length is caught too). ``append``
returns only after ``os.fsync``, so an acknowledged record survives a crash of the process (and,
on a disk that honours fsync, of the machine). A crash mid-append leaves a torn frame at the
end; opening the log truncates it, and the records before it are intact.

Snapshot file format: ``b"TMSNAP01" | u64 length | u32 crc32 | data``. It is written to a temp
file in the same directory, fsynced, renamed over the old snapshot and the directory fsynced,
so a reader sees either the old or the new snapshot, never half of one.

One writer per directory: the log takes an exclusive ``flock`` while open.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import zlib
from typing import Iterator

try:  # POSIX only; on other systems the single-writer rule is not enforced.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

__all__ = ["WriteAheadLog", "write_snapshot", "read_snapshot", "CorruptSnapshotError", "WAL_FILE", "SNAPSHOT_FILE"]

log = logging.getLogger(__name__)

WAL_FILE = "wal.log"
SNAPSHOT_FILE = "snapshot.bin"
_FRAME = struct.Struct("<II")  # length, crc32
_SNAP_MAGIC = b"TMSNAP01"
_SNAP_HEADER = struct.Struct("<8sQI")  # magic, length, crc32
_SNAP_TMP_PREFIX = f".{SNAPSHOT_FILE}."
_SNAP_TMP_SUFFIX = ".tmp"
_MAX_RECORD = 2**32 - 1


class CorruptSnapshotError(ValueError):
    """The snapshot file exists but fails its header or checksum check."""


def _crc(length_bytes: bytes, record) -> int:
    return zlib.crc32(record, zlib.crc32(length_bytes))


def _fsync_dir(directory: str) -> None:
    # Makes a created/renamed/removed directory entry durable (POSIX; a no-op elsewhere).
    if os.name != "posix":  # pragma: no cover
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _scan(path: str, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
    """Yield ``(end_offset, record)`` for each valid frame in the first ``limit`` bytes
    (default: the whole file) of ``path``, stopping at the first torn or corrupt frame."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size if limit is None else limit
        offset = 0
        while offset + _FRAME.size <= size:
            header = f.read(_FRAME.size)
            length, crc = _FRAME.unpack(header)
            # Checked before reading so a garbage length never triggers a huge allocation.
            if offset + _FRAME.size + length > size:
                return
            record = f.read(length)
            if len(record) < length or _crc(header[:4], record) != crc:
                return
            offset += _FRAME.size + length
            yield offset, record


class WriteAheadLog:
    """Append-only, fsynced record log in ``directory`` (file ``wal.log``)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, WAL_FILE)
        created = not os.path.exists(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise RuntimeError(
                        f"write-ahead log {self.path} is already open in another "
                        "WriteAheadLog (one writer per directory)"
                    ) from None
            if created:
                _fsync_dir(self.directory)
            self._count, valid_end = 0, 0
            for valid_end, _ in _scan(self.path):
                self._count += 1
            size = os.fstat(self._fd).st_size
            if size > valid_end:
                # A crash mid-append (or a corrupt frame): drop everything from the first bad
                # frame on, so new records are not appended after garbage.
                log.warning(
                    "write-ahead log %s: dropping %d bytes of torn or corrupt tail after %d valid records (offset %d)",
                    self.path,
                    size - valid_end,
                    self._count,
                    valid_end,
                )
                os.ftruncate(self._fd, valid_end)
                os.fsync(self._fd)
        except BaseException:
            self.close()  # also keeps __del__ from closing a reused descriptor number
            raise

    @property
    def count(self) -> int:
        """Number of records in the log."""
        return self._count

    def append(self, record: bytes | bytearray | memoryview) -> None:
        """Append one record; returns after it is on disk (fsync)."""
        if not isinstance(record, (bytes, bytearray, memoryview)):
            raise TypeError(f"WAL record must be bytes-like, got {type(record).__name__}")
        self._check_open()
        record = bytes(record)
        if len(record) > _MAX_RECORD:
            raise ValueError(f"WAL record of {len(record)} bytes exceeds the {_MAX_RECORD}-byte frame limit")
        length = struct.pack("<I", len(record))
        # One write per frame: a crash leaves at most this frame torn.
        _write_all(self._fd, length + struct.pack("<I", _crc(length, record)) + record)
        os.fsync(self._fd)
        self._count += 1

    def records(self) -> Iterator[bytes]:
        """The records in append order (replay after loading the last snapshot). Only records
        present when called are yielded, so replaying through a path that appends terminates."""
        self._check_open()
        limit = os.fstat(self._fd).st_size  # taken now, not at the first next()
        return (record for _, record in _scan(self.path, limit))

    def reset(self) -> None:
        """Empty the log durably (after a snapshot that covers its records)."""
        self._check_open()
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)
        self._count = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # also releases the flock
            self._fd = None

    def _check_open(self) -> None:
        if self._fd is None:
            raise ValueError(f"write-ahead log {self.path} is closed")

    def __enter__(self) -> "WriteAheadLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.close()

    def __repr__(self) -> str:
        return f"WriteAheadLog({self.path!r}, count={self._count})"


def write_snapshot(directory: str | os.PathLike, data: bytes | bytearray | memoryview) -> str:
    """Atomically replace ``directory``/snapshot.bin with ``data``; returns the path."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"snapshot data must be bytes-like, got {type(data).__name__}")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    # Temp files left by a crash mid-write are garbage (the rename never happened).
    for name in os.listdir(directory):
        if name.startswith(_SNAP_TMP_PREFIX) and name.endswith(_SNAP_TMP_SUFFIX):
            os.unlink(os.path.join(directory, name))
    data = memoryview(data).cast("B")
    header = _SNAP_HEADER.pack(_SNAP_MAGIC, len(data), zlib.crc32(data))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=_SNAP_TMP_PREFIX, suffix=_SNAP_TMP_SUFFIX)
    try:
        _write_all(fd, header)
        _write_all(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        path = os.path.join(directory, SNAPSHOT_FILE)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return path


def read_snapshot(directory: str | os.PathLike) -> bytes | None:
    """The last snapshot's data, or None if there is none; ``CorruptSnapshotError`` naming the
    file if it fails its checks."""
    path = os.path.join(os.fspath(directory), SNAPSHOT_FILE)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    if len(blob) < _SNAP_HEADER.size:
        raise CorruptSnapshotError(
            f"snapshot {path} is truncated: {len(blob)} bytes, shorter than its {_SNAP_HEADER.size}-byte header"
        )
    magic, length, crc = _SNAP_HEADER.unpack_from(blob)
    if magic != _SNAP_MAGIC:
        raise CorruptSnapshotError(f"snapshot {path} has magic {magic!r}, expected {_SNAP_MAGIC!r}")
    data = blob[_SNAP_HEADER.size :]
    if len(data) != length:
        raise CorruptSnapshotError(f"snapshot {path} holds {len(data)} data bytes, its header says {length}")
    if zlib.crc32(data) != crc:
        raise CorruptSnapshotError(f"snapshot {path} fails its crc32 check (corrupt data)")
    return data
