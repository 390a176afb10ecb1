"""``save_pretrained``'s files whose tensors are held in runs: each process writes its own bytes in place.

A safetensors file's layout is fixed by its tensors' names, shapes and dtypes, which every process
knows from the plan, so every tensor's byte offset is known everywhere before any data exists. A
tensor held in contiguous runs of its row-major elements (ZeRO-3's dim-0 shards, a column-wise
tensor-parallel weight, a pipeline stage's whole tensors, a replicated one) is then written by the
process holding each run, with ``os.pwrite`` at the run's offset: nothing travels between processes
and nobody holds more than its own shards. The bytes are those the streaming writer
(``hf_layout.SafetensorsWriter``) puts there: the same header, each run at its place.

The file's planned writer writes the header and sets the file's full length; every process opens
it with ``O_CREAT`` (no truncation: the staging folder is fresh), so no process waits for another
before writing. Each process fsyncs the files it wrote before it reports, so the bytes are durable
before the commit publishes them, on a local disk and on a shared file system alike (each client
flushes its own writes). A failure is kept and returned, never raised here: there is no collective
in this module, so the others finish theirs and the caller's all-reduce tells everyone.
"""

from __future__ import annotations

import os

import torch

from . import hf_layout
from .hf_layout import Entry, FilePlan
from .hf_save_plan import Item, by_file


class _Placed:
    """One file this process writes into: its descriptor and every tensor's byte offset."""

    def __init__(self, fd: int, offsets: dict[str, int]):
        self.fd, self.offsets = fd, offsets
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
        while len(data):  # pwrite may write less than asked (large runs, signals)
            done = os.pwrite(self.placed.fd, data, at)
            data, at = data[done:], at + done


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
    try:
        for plan, file_items in by_file(items, files):
            mine = [(item, piece) for item in file_items for piece in item.pieces if piece[0] == rank]
            if error is not None or not (mine or plan.writer == rank):
                continue
            try:
                head, offsets = hf_layout.header_bytes(plan)
                fd = os.open(os.path.join(staging, plan.filename), os.O_WRONLY | os.O_CREAT, 0o666)
                placed = _Placed(fd, offsets)
                opened.append(placed)
                if plan.writer == rank:  # the header, and the full length (runs beyond it fill in)
                    os.pwrite(fd, head, 0)
                    os.ftruncate(fd, len(head) + plan.nbytes)
                for item, (_, start, count) in mine:
                    run = _Run(placed, item.entry, start)
                    _write_tensor(run, item.entry, _piece(local_part(local[item.source]), item, rank, start, count))
            except Exception as exc:
                error = exc
        for placed in opened:  # durable before this process reports success
            try:
                if error is None:
                    os.fsync(placed.fd)
            except Exception as exc:
                error = exc
    finally:
        for placed in opened:
            written += placed.written
            os.close(placed.fd)
    return error, written
