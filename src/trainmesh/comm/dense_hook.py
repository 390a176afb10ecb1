"""The DDP hook without compression: exact fp32 all-reduce (flat or hierarchical) with the same
background overlap and bucket merging as the compressed hook.

It exists apart from ``ddp_hooks.py`` because it shares only the bucket worker with the compressed
hook: no compressor, no residuals, no per-kind exchange.
"""

from __future__ import annotations

from typing import Callable

import torch

from .bucket_exchanges import _nbytes
from .bucket_worker import BucketMerger, BucketWorker


# --- no compression: the same overlap and bucket merging for exact fp32 all-reduce ------------
class DenseHookState:
    """State of :func:`dense_allreduce_hook`: ``all_reduce`` (flat or hierarchical) sums in place.

    Used for hierarchical all-reduce without compression, and by ``communication="auto"`` when
    it merges buckets; the plain flat case is left to DDP's own (already overlapped) all-reduce.
    """

    def __init__(
        self,
        world_size: int,
        all_reduce: Callable[[torch.Tensor], None],
        *,
        overlap: bool = True,
        bucket_bytes: int = 0,
    ) -> None:
        self.world_size, self.all_reduce = world_size, all_reduce
        self.worker = BucketWorker() if overlap else None
        self.merger = BucketMerger(self.worker, self._reduce, bucket_bytes) if self.worker is not None else None

    def _reduce(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = buffers[0] if len(buffers) == 1 else torch.cat([b.reshape(-1) for b in buffers])
        self.all_reduce(flat)
        flat.div_(self.world_size)
        return list(flat.split([b.numel() for b in buffers])) if len(buffers) > 1 else [flat]


def dense_allreduce_hook(state: DenseHookState, bucket):  # -> Future[Tensor]
    """``ddp_model.register_comm_hook(DenseHookState(n, all_reduce), dense_allreduce_hook)``."""
    buffer = bucket.buffer()
    if state.merger is None:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(state._reduce([buffer])[0])
        return future
    return state.merger.add(buffer, _nbytes(buffer), bucket.is_last())


__all__ = ["DenseHookState", "dense_allreduce_hook"]
