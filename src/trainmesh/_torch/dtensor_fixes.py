"""Two corrections to DTensor's op coverage, so a model written for one device gives the
same numbers when its tensors are DTensors.

* ``aten.mse_loss_backward`` has no DTensor sharding rule and falls back to running on the
  local shards, where ``2 / input.numel()`` uses the *local* element count: with the batch
  split over k processes, every gradient came out k times too large (measured on torch
  2.13). We recompute it from DTensor ops, whose ``numel()`` is global.
* ``tensor.item()`` on a DTensor returned this process's local value, which for a
  ``Partial`` loss is only a share of it. We return the global value, as one device would.
  This is a collective: every process must call ``item()`` on the same tensor (SPMD).

Installed once, on first use of a ModelParallel distribution.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor

aten = torch.ops.aten
_installed = [False]


def _mse_loss_backward(op_call, args, kwargs):
    grad_output, input_, target, reduction = (list(args) + [kwargs.get("reduction", 1)])[:4]
    norm = 2.0 / input_.numel() if reduction == 1 else 2.0  # 1 == Reduction.MEAN
    return norm * (input_ - target) * grad_output


def _global_item(op_call, args, kwargs):
    return args[0].full_tensor().item()


def install_dtensor_fixes() -> None:
    if _installed[0]:
        return
    # DTensor logs a performance warning for every 2-axis reduction of a Partial scalar (the loss,
    # each step); for a scalar it costs nothing worth a warning per step.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers.setdefault(aten.mse_loss_backward.default, _mse_loss_backward)
    handlers.setdefault(aten._local_scalar_dense.default, _global_item)
    _installed[0] = True
