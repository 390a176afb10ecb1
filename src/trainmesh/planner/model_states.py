"""The optimizer a plan builds over the parallelized parameters (``"adam"``, ``"adamw"``, ``"sgd"``,
a class, or a callable). Its state is not tabulated: the dry run (``dry_run.py``) builds this optimizer
over the very parameters ``parallelize`` left on a rank and steps it once on fake tensors, so Adam's
``exp_avg`` + ``exp_avg_sq`` (+ a ``step``), SGD's momentum, ``amsgrad``'s third buffer, bf16 states
under ``bf16-true`` and ZeroRedundancyOptimizer's partition are whatever torch creates.

>>> type(resolve_optimizer("sgd")([__import__("torch").nn.Parameter(__import__("torch").zeros(2))])).__name__
'SGD'
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def resolve_optimizer(optimizer: Any) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``"adam"``/``"adamw"``/``"sgd"`` (momentum 0.9), an optimizer class, or a ``params -> optimizer`` callable."""
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in _OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {sorted(_OPTIMIZERS)}, an optimizer class or a callable. "
                f"Received: optimizer={optimizer!r}"
            )
        if key == "sgd":
            return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return lambda params: _OPTIMIZERS[key](params)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        # SGD's lr had no default before torch 2.2; every other built-in has one.
        return lambda params: optimizer(params, lr=1e-3)
    if callable(optimizer):
        return optimizer
    raise TypeError(f"optimizer must be a name, an optimizer class or a callable. Received: {optimizer!r}")
