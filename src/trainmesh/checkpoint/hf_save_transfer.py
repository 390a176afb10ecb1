"""``save_pretrained``'s files with a tensor that must be gathered whole (a row-wise tensor-parallel
weight): each file goes to one writer, which streams it tensor by tensor; a tensor held in runs
travels to it point to point over a gloo group, a gathered one by ``full_tensor`` (a collective on
its mesh). Each writer fsyncs its closed files in a thread beside the next ones. A writer that fails
keeps receiving, so no process hangs. (Files held wholly in runs: ``hf_save_direct``.)
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from . import hf_layout
from .hf_layout import Entry, FilePlan
from .hf_save_plan import Item, by_file


class _Sink:
    """The writer's end of one file; after a failure it keeps receiving (senders must not hang)."""

    def __init__(self, path: str, plan: FilePlan):
        self.writer = hf_layout.SafetensorsWriter(path, plan)
        self.error: BaseException | None = None

    def put(self, entry: Entry, tensor: torch.Tensor) -> None:
        if self.error is None:
            try:
                _write_tensor(self.writer, entry, tensor)
            except Exception as exc:
                self.error = exc
                self.writer.abort()

    def close(self) -> BaseException | None:
        if self.error is None:
            try:
                self.writer.close(sync=False)  # fsynced by _Syncer, beside the next files' transfers
            except Exception as exc:
                self.error = exc
        return self.error


class _Syncer:
    """fsyncs this writer's closed files in a thread of its own. Every process walks the files in
    the same order, so an fsync in that walk held every other process at its next file (a file's
    fsync costs about as long as writing it); here it overlaps the transfers of the next files,
    and ``finish`` waits for the last. Nothing is published before every fsync returned."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []

    def submit(self, path: str) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainmesh-fsync")
        self._futures.append(self._pool.submit(_fsync_file, path))

    def finish(self) -> BaseException | None:
        error = None
        for future in self._futures:
            error = error or future.exception()
        if self._pool is not None:
            self._pool.shutdown()
        return error


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # raises where the write-back failed (EIO, ENOSPC): reported like a write error
    finally:
        os.close(fd)


def _write_tensor(writer: hf_layout.SafetensorsWriter, entry: Entry, tensor: torch.Tensor) -> None:
    """One tensor, or the next piece of one, into its file (a module-level step so tests can fail it)."""
    writer.write(entry.name, tensor.to(entry.dtype))


def gather_and_write(
    local, items: list[Item], files: list[FilePlan], staging: str, rank: int, group
) -> BaseException | None:
    """Files with a tensor that must be gathered whole (the others are written in place by
    ``hf_save_direct``): every process walks the same files, each streamed by its writer tensor by
    tensor, a collective per gathered tensor, and fsynced in a thread beside the next files."""
    error: BaseException | None = None
    syncer = _Syncer()
    try:  # a failed collective still waits for the fsyncs already handed to the thread
        for plan, file_items in by_file(items, files):
            sink = None
            if plan.writer == rank:
                try:
                    sink = _Sink(os.path.join(staging, plan.filename), plan)
                except Exception as exc:
                    error = exc
            for item in file_items:
                _move(local, item, rank, group, sink)
            if sink is not None:
                closed = sink.close()
                error = closed or error
                if closed is None:
                    syncer.submit(sink.writer.path)
    finally:
        synced = syncer.finish()  # always waited for: nothing is published before the bytes are durable
    return error or synced


def _piece(flat: torch.Tensor, item: Item, rank: int, start: int, count: int) -> torch.Tensor:
    """The elements ``[start, start + count)`` of ``item`` out of this process's flat run of its source: all
    of the run for a whole tensor; a slice of it for one expert of fused experts (``item.offset``)."""
    first = item.offset + start - item.ranges[rank][0]
    return flat[first : first + count]


def _move(local, item: Item, rank: int, group, sink: _Sink | None) -> None:
    from .._torch.shard_ranges import full_tensor, local_part

    writing = rank == item.writer
    if item.pieces is not None:
        for sender, start, count in item.pieces:
            part = None
            if rank == sender:
                part = _piece(local_part(local[item.source]), item, rank, start, count)
                if writing:
                    _put(sink, item.entry, part)
                else:
                    dist.send(part.contiguous(), dst=item.writer, group=group)
            elif writing:
                part = torch.empty(count, dtype=item.source_dtype)
                dist.recv(part, src=sender, group=group)
                _put(sink, item.entry, part)
        return
    # Not in runs: the holders gather it whole (a collective on its mesh); one sends it on if need be.
    value = full_tensor(local[item.source]) if rank in item.holders else None
    if value is not None and (item.offset or value.numel() != item.entry.numel):  # one run of fused experts
        value = value.reshape(-1)[item.offset : item.offset + item.entry.numel].view(item.entry.shape)
    if item.writer not in item.holders:
        if rank == item.holders[0]:
            dist.send(value.contiguous(), dst=item.writer, group=group)
        elif writing:
            value = torch.empty(item.entry.shape, dtype=item.source_dtype)
            dist.recv(value, src=item.holders[0], group=group)
    if writing:
        _put(sink, item.entry, value)


def _put(sink: _Sink | None, entry: Entry, tensor: torch.Tensor) -> None:
    if sink is not None:  # None: this writer could not open its file; the data is dropped
        sink.put(entry, tensor)
