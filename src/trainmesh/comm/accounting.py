"""Bytes accounting for gradient communication: what one rank sends per optimizer step.

What counts (one definition everywhere: step records, progress bar, benchmarks):

* ``compressed``: the payload bytes this rank contributes to the gradient collectives of one
  optimizer step: the tensors it hands to all-reduce / all-gather (the ``Compressed.tensors``
  of every gradient, packed). Each payload is counted once, however many peers receive it.
* ``uncompressed``: the bytes the same gradients would contribute without compression
  (``numel x element size`` of the gradients as DDP would all-reduce them, or of FSDP2's
  padded reduce-scatter input at ZeRO stages 2-3).

``wire`` / ``dense_wire``: the bytes this rank actually sends for the collectives it ran (across
hosts only, when the reduction is hierarchical), and what the same reduction path would send in
fp32. This is the figure a slow network cares about: an all-gathered payload reaches N-1 peers,
a two-phase exchange sends about twice its payload; ``wire_ratio`` compares like with like.

Not counted: the small control traffic (loss, stop flag, gradient norm, one-off layout checks)
and protocol overhead. The wire traffic depends on the collective: a ring all-reduce moves
``2 (N-1)/N`` x its payload through each rank, an all-gather ``(N-1)`` x (every peer's payload
arrives at every rank), an all-to-all ``(N-1)/N`` x (each peer gets only its row). So on N processes an all-gathered payload must be more than
``N / 2`` times smaller than the dense gradient to win on the wire too; ``ratio`` here is the
payload ratio, the figure compression papers and DeepSpeed/Horovod report.

>>> counter = ByteCounter()
>>> counter.add(sent=1_000, dense=4_000); counter.add(sent=250, dense=1_000)
>>> step = counter.take()
>>> (step.compressed, step.uncompressed, step.ratio)
(1250, 5000, 4.0)
>>> counter.take().compressed   # reset by take()
0
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class StepBytes:
    """Bytes one rank contributed to gradient collectives in one optimizer step."""

    compressed: int
    uncompressed: int
    wire: int = 0
    dense_wire: int = 0

    @property
    def ratio(self) -> float:
        """uncompressed / compressed (1.0 when nothing was sent)."""
        return self.uncompressed / self.compressed if self.compressed else 1.0

    @property
    def wire_ratio(self) -> float:
        """fp32 wire bytes / wire bytes sent (1.0 when nothing was sent)."""
        return self.dense_wire / self.wire if self.wire else 1.0

    def as_record(self) -> dict[str, float]:
        """The keys the Trainer's step records carry."""
        record = {"comm_bytes": self.compressed, "comm_bytes_uncompressed": self.uncompressed, "comm_ratio": self.ratio}
        if self.wire:
            record.update(comm_wire_bytes=self.wire, comm_wire_bytes_fp32=self.dense_wire)
        return record


def ring_wire_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``world`` processes."""
    return 0 if world <= 1 else int(2 * (world - 1) * nbytes // world)


class ByteCounter:
    """Accumulates :class:`StepBytes` between ``take`` calls (DDP hooks add per bucket).

    A lock, because DDP may run a communication hook on autograd's thread while the loop reads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent = self._dense = self._wire = self._dense_wire = 0
        self.total_sent = 0  # over the whole run, for summaries
        self.total_dense = 0
        self.total_wire = 0

    def add(self, *, sent: int, dense: int, wire: int = 0, dense_wire: int = 0) -> None:
        if min(sent, dense, wire, dense_wire) < 0:
            raise ValueError(
                f"byte counts must be >= 0. Received: sent={sent}, dense={dense}, wire={wire}, dense_wire={dense_wire}"
            )
        with self._lock:
            self._sent += int(sent)
            self._dense += int(dense)
            self._wire += int(wire)
            self._dense_wire += int(dense_wire)
            self.total_sent += int(sent)
            self.total_dense += int(dense)
            self.total_wire += int(wire)

    def take(self) -> StepBytes:
        """The bytes since the last ``take`` (one optimizer step when called once per step)."""
        with self._lock:
            step = StepBytes(self._sent, self._dense, self._wire, self._dense_wire)
            self._sent = self._dense = self._wire = self._dense_wire = 0
        return step


def format_bytes(count: float) -> str:
    """``512B``, ``1.5KB``, ``24.0MB``, ``1.2GB`` (powers of 1024, one decimal).

    >>> format_bytes(1536), format_bytes(25 * 2**20)
    ('1.5KB', '25.0MB')
    """
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1024 or unit == "GB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}GB"  # unreachable; keeps type checkers calm


def describe_step(step: StepBytes) -> str:
    """For the progress bar: ``1.0MB/4.0MB (4.0x)``."""
    return f"{format_bytes(step.compressed)}/{format_bytes(step.uncompressed)} ({step.ratio:.1f}x)"
