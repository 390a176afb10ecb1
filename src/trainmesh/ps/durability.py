"""A server's durable store: its write-ahead log and snapshots in one directory.

``"wal"``: every mutating request frame is appended and fsynced before it is applied (and so
before its ack); a snapshot every ``snapshot_every`` updates (or ``snapshot_every_s``) lets the
log be truncated. ``"snapshot"``: no log, only the periodic snapshots. A snapshot is a sequence
of length-prefixed protocol frames (the server's JSON state, then one per shard; no pickle)
inside ``wal.write_snapshot``'s checksummed, atomically replaced file.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Callable

import torch

from .protocol import FLAG_SESSION, Message, MessageType, ProtocolError, encode, frame_flags
from .frame_decode import decode
from .session import signed_record
from .wal import WriteAheadLog, read_snapshot, write_snapshot

DURABILITY = ("none", "snapshot", "wal")  # when a push is acknowledged: see docs/parameter_server.md

log = logging.getLogger(__name__)
_SNAPSHOT_MAX_BYTES = 1 << 40  # local files: only the disk limits them
_LENGTH = struct.Struct("<Q")  # before each frame of a snapshot


class DurableStore:
    def __init__(self, directory: str, secret, *, log_pushes: bool, snapshot_every: int, snapshot_every_s: float):
        self.directory = directory
        self.secret = secret
        self.wal = WriteAheadLog(directory) if log_pushes else None
        self.snapshot_every, self.snapshot_every_s = snapshot_every, snapshot_every_s
        self.updates_since_snapshot = 0
        self.last_snapshot = time.monotonic()
        self.snapshots_written = 0
        self.retry_at = 0.0  # after a failed snapshot, not before this time

    def log(self, frame) -> None:
        if self.wal is None:
            return
        if self.secret is not None and frame_flags(frame) == FLAG_SESSION:
            # Sealed with a connection's session token: a replay could not check that, so the record
            # gets the secret's HMAC (the cost of a hash only where every push is fsynced anyway).
            self.wal.append(signed_record(frame, self.secret))
        else:  # a message received as several parts is logged as one record
            self.wal.append(b"".join(frame) if isinstance(frame, (list, tuple)) else frame)

    def count_update(self) -> None:
        self.updates_since_snapshot += 1

    def snapshot_due(self) -> bool:
        if self.updates_since_snapshot == 0 or time.monotonic() < self.retry_at:
            return False
        return (
            self.updates_since_snapshot >= self.snapshot_every
            or time.monotonic() - self.last_snapshot >= self.snapshot_every_s
        )

    def write_snapshot(self, meta: dict, shards: dict[str, tuple[dict[str, torch.Tensor], dict]]) -> None:
        """``meta``: the server's JSON state; ``shards``: ``{id: (tensors, shard meta)}``. One
        frame per shard, so no header outgrows the protocol's limit however many shards."""
        frames = [encode(Message(MessageType.IMPORT, "snapshot", 0, meta=meta), None, _SNAPSHOT_MAX_BYTES)]
        for sid, (tensors, shard_meta) in shards.items():
            frames.append(
                encode(
                    Message(
                        MessageType.IMPORT, "snapshot", 0, tensors=tensors, meta={"shard_id": sid, "shard": shard_meta}
                    ),
                    None,
                    _SNAPSHOT_MAX_BYTES,
                )
            )
        write_snapshot(self.directory, b"".join(part for f in frames for part in (_LENGTH.pack(len(f)), f)))
        if self.wal is not None:
            self.wal.reset()  # only after the snapshot covering its records is on disk
        self.updates_since_snapshot = 0
        self.last_snapshot = time.monotonic()
        self.snapshots_written += 1

    def load_snapshot(self) -> tuple[dict, dict[str, tuple[dict[str, torch.Tensor], dict]]] | None:
        """``(meta, shards)`` as given to ``write_snapshot``, or None when there is none yet."""
        data = read_snapshot(self.directory)
        if data is None:
            return None
        view, frames, offset = memoryview(data), [], 0
        while offset < len(view):
            (length,) = _LENGTH.unpack_from(view, offset)
            frames.append(
                decode(view[offset + _LENGTH.size : offset + _LENGTH.size + length], None, _SNAPSHOT_MAX_BYTES)
            )
            offset += _LENGTH.size + length
        shards = {f.meta["shard_id"]: (f.tensors, f.meta["shard"]) for f in frames[1:]}
        return frames[0].meta, shards

    def replay(self, mutate: Callable[[Message], None]) -> int:
        """Apply every logged frame through ``mutate`` (dedup makes it idempotent)."""
        if self.wal is None:
            return 0
        count = 0
        for index, record in enumerate(self.wal.records()):
            try:
                msg = decode(record, self.secret, _SNAPSHOT_MAX_BYTES)
            except ProtocolError as error:
                raise RuntimeError(
                    f"write-ahead log {self.wal.path}: record {index} does not decode "
                    f"(was the server restarted with another secret?): {error}"
                ) from error
            mutate(msg)
            count += 1
        if count:
            log.info("replayed %d write-ahead log records from %s", count, self.wal.path)
        return count

    def close(self) -> None:
        if self.wal is not None:
            self.wal.close()
