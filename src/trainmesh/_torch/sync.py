"""Gradient-synchronisation controls that work for every distributed model kind."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from .data_axis_grads import no_grad_sync


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule) -> Iterator[None]:
    """No reduce-scatter in this backward: each unit keeps its *unsharded* gradient and adds the
    next micro-step's to it (FSDP2's trade-off: one reduce-scatter per step instead of one per
    micro-step, at the price of holding full-size gradients until the final micro-step)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """Skip gradient communication for the forward+backward inside (non-final micro-steps)."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        # ZeRO 2-3 keep gradients sharded at every micro-step (reduce-scatter each, add into the shard);
        # ZeRO-1 accumulates unsharded ones locally and reduces once at the boundary (``zero.py``).
        stage = getattr(model, "_trainmesh_memory", {}).get("zero_stage", 1)
        return _fsdp_no_sync(model) if stage <= 1 else contextlib.nullcontext()
    if getattr(model, "_trainmesh_distribution", None) is not None:
        return no_grad_sync()
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper (an FSDP2 model is the user's module itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def runs_collectives_in_forward(model: nn.Module) -> bool:
    """Whether every process must enter every forward together (FSDP2 models), even one with no
    rows of the batch to process. A tensor-parallel model's model-axis group shares one slice of
    the batch, so its processes skip an empty share together."""
    return isinstance(model, FSDPModule)
