"""``save_pretrained``'s files whose tensors are held in runs: each process writes its own bytes in place.

A safetensors file's layout is fixed by its tensors' names, shapes and dtypes, which every process
knows from the plan, so every tensor's byte offset is known everywhere before any data exists. A
tensor held in contiguous runs of its row-major elements (ZeRO-3's dim-0 shards, a column-wise
tensor-parallel weight, a pipeline stage's whole tensors, a replicated one) is then written by the
process holding each run, at the run's offset (its whole pages with ``O_DIRECT``, around the page
cache: ``direct_write``): nothing travels between processes
and nobody holds more than its own shards. The bytes are those the streaming writer
(``hf_layout.SafetensorsWriter``) puts there: the same header, each run at its place.

The file's planned writer writes the header and sets the file's full length; every process opens
it with ``O_CREAT`` (no truncation: the staging folder is fresh), so no process waits for another
before writing. Each process fsyncs the files it wrote before it reports, so the bytes are durable
before the commit publishes them, on a local disk and on a shared file system alike (each client
flushes its own writes). A failure is kept and returned, never raised here: there is no collective
in this module, so the others finish theirs and the caller's all-reduce tells everyone.

Each process walks the files from a different one (``turns``): process p writes its runs of file
(p + k) mod F at its k-th turn, so while there are at least as many files as processes, no two
write one file at once. On ext4 (and most local file systems) a buffered write holds the file's
inode lock, and a new page cache page is allocated under it; every process writing the same file
in the same order serialized on that lock (measured, 4 processes x 88 MB into fresh pages: 2.0-2.6 s
into one file, 0.9-2.0 s rotated over 4 files, 1.4-2.1 s for one process writing all 352 MB). No
barrier keeps the turns: each process's share of a file is about the same, so they stay in step.
(ext4 holds that lock for a direct write into a not yet written part of a file too.)
"""

from __future__ import annotations

import os

import torch

from . import hf_layout
from .direct_write import DirectWriter, bounce_buffer
from .hf_layout import Entry, FilePlan
from .hf_save_plan import Item, by_file


class _Placed:
    """One file this process writes into: its writer (whole pages around the page cache,
    ``direct_write``) and every tensor's byte offset."""

    def __init__(self, writer: DirectWriter, offsets: dict[str, int]):
        self.writer, self.offsets = writer, offsets
        self.written = 0  # bytes this process wrote into it


class _Run:
    """What ``hf_save_transfer._write_tensor`` is handed for one run: a writer whose ``write`` places
    the run at its offset (the hook the streaming path goes through too, so tests can fail it)."""

    def __init__(self, placed: _Placed, entry: Entry, start: int):
        self.placed, self.entry, self.start = placed, entry, start

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name != self.entry.name or tensor.dtype != self.entry.dtype:
            raise ValueError(f"expected a run of {self.entry.name!r} ({self.entry.dtype}), got {name!r} {tensor.dtype}")
        data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        at = self.placed.offsets[name] + self.start * self.entry.dtype.itemsize
        self.placed.written += len(data)
        self.placed.writer.write(data, at)


def turns(planned: list, rank: int) -> list:
    """The files in this process's order: from file ``rank mod F`` on, wrapping around, so at every
    turn the processes are spread over different files (the same file only when F < processes)."""
    first = rank % len(planned) if planned else 0
    return planned[first:] + planned[:first]


def in_runs(items: list[Item]) -> bool:
    return all(item.pieces is not None for item in items)


def write_in_place(
    local, items: list[Item], files: list[FilePlan], staging: str, rank: int
) -> tuple[BaseException | None, int]:
    """Write this process's runs of ``files`` (every tensor of them held in runs); returns the first
    error (or None) and the bytes written. Not collective."""
    from .._torch.shard_ranges import local_part
    from .hf_save_transfer import _piece, _write_tensor

    error: BaseException | None = None
    written, opened = 0, []
    bounce = bounce_buffer()  # one for every file this process writes
    try:
        for plan, file_items in turns(list(by_file(items, files)), rank):
            mine = [(item, piece) for item in file_items for piece in item.pieces if piece[0] == rank]
            if error is not None or not (mine or plan.writer == rank):
                continue
            try:
                head, offsets = hf_layout.header_bytes(plan)
                placed = _Placed(DirectWriter(os.path.join(staging, plan.filename), bounce), offsets)
                opened.append(placed)
                if plan.writer == rank:  # the header, and the full length (runs beyond it fill in)
                    os.pwrite(placed.writer.fd, head, 0)
                    os.ftruncate(placed.writer.fd, len(head) + plan.nbytes)
                for item, (_, start, count) in mine:
                    run = _Run(placed, item.entry, start)
                    _write_tensor(run, item.entry, _piece(local_part(local[item.source]), item, rank, start, count))
            except Exception as exc:
                error = exc
        for placed in opened:  # durable before this process reports success
            try:
                if error is None:
                    placed.writer.fsync()
            except Exception as exc:
                error = exc
    finally:
        for placed in opened:
            written += placed.written
            placed.writer.close()
        bounce.close()
    return error, written
