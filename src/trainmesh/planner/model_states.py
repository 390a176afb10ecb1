"""Bytes of parameters, gradients and optimizer state, from real shapes, and their split per ZeRO stage.

The optimizer's state is not guessed from a table: the real optimizer class is built over the
meta parameters and stepped once with meta gradients (torch's optimizers run on meta), and the
state tensors it created are summed. So ``Adam`` counts ``exp_avg`` + ``exp_avg_sq`` (+ a 4-byte
``step``), ``SGD(momentum=0.9)`` a ``momentum_buffer``, ``SGD()`` nothing, ``amsgrad`` one more.

Precision follows the Trainer (``trainer/precision.py``): the mixed modes keep fp32 parameters,
fp32 gradients and fp32 optimizer state (autocast only changes activations); ``bf16-true`` turns
the module to bf16, so parameters, gradients and the state ``zeros_like`` creates are bf16.

Per-rank division (``trainmesh.distribution.memory_options``: stage 0 DDP, 1 DDP +
ZeroRedundancyOptimizer, 2/3 FSDP2): a sharded tensor costs ``ceil(dim0 / N) * rest`` elements on
the fullest rank, as FSDP2 pads dim-0 shards; scalars (Adam's ``step``) stay whole.

>>> import torch
>>> states = count_model_states(torch.nn.Linear(10, 10, device="meta"), "fp32", "adam")
>>> (states.param_bytes, states.grad_bytes, states.optimizer_bytes)
(440, 440, 888)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


@dataclass(frozen=True)
class TensorShape:
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def shard_nbytes(self, world_size: int) -> int:
        """Bytes on the fullest rank when split on dim 0 (padded to equal chunks, as FSDP2 does)."""
        if not self.shape:
            return self.nbytes
        return -(-self.shape[0] // world_size) * math.prod(self.shape[1:]) * self.itemsize


@dataclass(frozen=True)
class ParamStates:
    """One parameter: its name, its shape/dtype, its gradient's, and each optimizer state tensor's."""

    name: str
    param: TensorShape
    grad: TensorShape
    optimizer: tuple[TensorShape, ...]


@dataclass(frozen=True)
class ModelStates:
    """Everything the model holds between steps, unsharded (one full replica)."""

    params: tuple[ParamStates, ...]
    buffer_bytes: int

    @property
    def param_bytes(self) -> int:
        return sum(p.param.nbytes for p in self.params)

    @property
    def grad_bytes(self) -> int:
        return sum(p.grad.nbytes for p in self.params)

    @property
    def optimizer_bytes(self) -> int:
        return sum(s.nbytes for p in self.params for s in p.optimizer)

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(p.param.shape) for p in self.params)

    def subset(self, prefixes: list[str]) -> "ModelStates":
        """The parameters under any of the module paths ``prefixes`` ('' = everything)."""
        keep = tuple(p for p in self.params
                     if any(not pre or p.name == pre or p.name.startswith(pre + ".") for pre in prefixes))
        return ModelStates(keep, 0)

    def sharded(self, world_size: int) -> tuple[int, int, int]:
        """(params, grads, optimizer) bytes on the fullest rank when everything is dim-0 sharded."""
        return (sum(p.param.shard_nbytes(world_size) for p in self.params),
                sum(p.grad.shard_nbytes(world_size) for p in self.params),
                sum(s.shard_nbytes(world_size) for p in self.params for s in p.optimizer))


def resolve_optimizer(optimizer: Any) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``"adam"``/``"adamw"``/``"sgd"`` (momentum 0.9), an optimizer class, or a ``params -> optimizer`` callable."""
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZERS)}, an optimizer class or a callable. "
                             f"Received: optimizer={optimizer!r}")
        if key == "sgd":
            return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return lambda params: _OPTIMIZERS[key](params)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        # SGD's lr had no default before torch 2.2; every other built-in has one.
        return lambda params: optimizer(params, lr=1e-3)
    if callable(optimizer):
        return optimizer
    raise TypeError(f"optimizer must be a name, an optimizer class or a callable. Received: {optimizer!r}")


def _optimizer_state(model: nn.Module, optimizer: Any) -> dict[int, tuple[TensorShape, ...]]:
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = resolve_optimizer(optimizer)(params)
    try:
        opt.step()
    except Exception:  # noqa: BLE001
        # Built-in optimizers create their state before any arithmetic that could need real values
        # (an ``.item()``), so a step that fails on meta has usually initialised the state anyway.
        if not opt.state:
            raise
    out = {}
    for p in params:
        tensors = [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        out[id(p)] = tuple(TensorShape(tuple(t.shape), t.element_size()) for t in tensors)
        p.grad = None
    return out


def count_model_states(meta_model: nn.Module, precision: str, optimizer: Any = "adam") -> ModelStates:
    """Count a meta model's states for ``precision``; ``meta_model`` is converted in place for bf16-true."""
    if precision == "bf16-true":
        meta_model.to(torch.bfloat16)
    state = _optimizer_state(meta_model, optimizer)
    params = []
    for name, p in meta_model.named_parameters():  # shared (tied) parameters are listed once
        shape = TensorShape(tuple(p.shape), p.element_size())
        grad = shape if p.requires_grad else TensorShape((0,), p.element_size())
        params.append(ParamStates(name, shape, grad, state.get(id(p), ())))
    buffers = sum(b.numel() * b.element_size() for b in meta_model.buffers())
    return ModelStates(tuple(params), buffers)
