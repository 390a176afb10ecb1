"""Gradient averaging over the batch axis for a tensor-parallel model without ZeRO (DDP's job, for DTensors).

DDP cannot wrap a module whose parameters are DTensors, and FSDP2 would shard them; at ZeRO
stage 0 each process keeps whole (model-axis-sharded) parameters and only needs its gradients
averaged with the processes holding the other slices of the batch. Each parameter's gradient
is all-reduced asynchronously the moment autograd has accumulated it, so communication
overlaps the rest of backward, and the reductions are awaited once, when backward ends.

``no_grad_sync()`` skips the reduction (non-final micro-steps of gradient accumulation), as
DDP's ``no_sync`` does; the accumulated gradient is then reduced once, on the final micro-step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

_grad_sync_enabled = [True]


@contextlib.contextmanager
def no_grad_sync() -> Iterator[None]:
    previous = _grad_sync_enabled[0]
    _grad_sync_enabled[0] = False
    try:
        yield
    finally:
        _grad_sync_enabled[0] = previous


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if isinstance(grad, DTensor) else grad


class DataAxisGradReducer:
    """Averages every parameter's gradient over ``group`` (the batch axis), overlapped with backward."""

    def __init__(self, model: nn.Module, group, size: int):
        self.group, self.size = group, size
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._callback_queued = False
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
            # A gradient that arrived with other placements (Partial over the model axis) is
            # brought to its parameter's first, so every process reduces the same layout.
            grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
        if not _grad_sync_enabled[0] or self.size == 1:
            return
        local = _local(grad)
        self._pending.append((dist.all_reduce(local, group=self.group, async_op=True), local))
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        pending, self._pending, self._callback_queued = self._pending, [], False
        for work, local in pending:
            work.wait()
            local.div_(self.size)  # gloo has no AVG: sum, then divide
