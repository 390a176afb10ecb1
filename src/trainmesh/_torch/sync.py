"""Gradient-synchronisation controls that work for every distributed model kind."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .tensor_parallel import no_grad_sync


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """Skip gradient communication for the forward+backward inside (non-final micro-steps)."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if getattr(model, "_trainmesh_distribution", None) is not None:
        return no_grad_sync()
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper."""
    return model.module if isinstance(model, DistributedDataParallel) else model
