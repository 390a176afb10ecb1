"""Shape-only copies of a model: on the meta device (no storage at all) and as fake CPU tensors.

The planner never allocates a model's real storage. ``build_meta_model`` runs a factory under
``torch.device("meta")`` or deep-copies an instance with every parameter and buffer swapped for a
meta tensor of the same shape, dtype and stride (tied weights stay tied: the swap goes through
``deepcopy``'s memo, keyed by the original tensor).

Meta tensors are not enough for activations: kernels are chosen by device, so on ``meta``
``scaled_dot_product_attention`` takes the math path (it saves the T x T attention matrix that
the CPU flash kernel does not) and CPU autocast does not apply at all. ``to_fake`` therefore
makes a :class:`FakeTensorMode` copy whose tensors claim to live on ``device`` (still without
storage), so the forward dispatches exactly as the real one would.

>>> import torch
>>> model = build_meta_model(lambda: torch.nn.Linear(4, 2))
>>> model.weight.device.type
'meta'
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn


def _swap_copy(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    memo: dict[int, object] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        new = make(tensor)
        memo[id(tensor)] = (
            nn.Parameter(new, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
        )
    return copy.deepcopy(model, memo)


def build_meta_model(model_or_factory: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """A meta-device model from a module instance (left untouched) or a zero-argument factory."""
    if isinstance(model_or_factory, nn.Module):
        return _swap_copy(
            model_or_factory, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        )
    if not callable(model_or_factory):
        raise TypeError(
            "model_or_factory must be a torch.nn.Module or a callable returning one. "
            f"Received: {type(model_or_factory).__name__}"
        )
    try:
        with torch.device("meta"):
            model = model_or_factory()
    except Exception as exc:  # noqa: BLE001 - say what the planner needs, keep the cause
        raise ValueError(
            "The model factory failed on the meta device (it must not load weights or read tensor "
            f"values while constructing). Received error: {exc!r}"
        ) from exc
    if not isinstance(model, nn.Module):
        raise TypeError(f"The factory must return a torch.nn.Module. Received: {type(model).__name__}")
    # A factory may have pinned some tensors to a real device despite the default; copy those too.
    if any(t.device.type != "meta" for t in [*model.parameters(), *model.buffers()]):
        model = build_meta_model(model)
    return model


def to_fake(model: nn.Module, mode, device: str = "cpu") -> nn.Module:
    """A copy of ``model`` whose tensors are fakes on ``device``; call inside ``mode`` afterwards too."""
    with mode:
        return _swap_copy(model, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))


def find_blocks(model: nn.Module) -> list[str]:
    """Paths of the repeated blocks: the children of the ``ModuleList``/``Sequential`` holding most parameters.

    These are the natural FSDP units and checkpointing targets of a transformer (``blocks.0``, ...).
    Returns ``[]`` when no container has at least two children with parameters.
    """
    best: list[str] = []
    best_numel = 0
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(name, child) for name, child in module.named_children() if any(True for _ in child.parameters())]
        if len(children) < 2:
            continue
        numel = sum(p.numel() for _, child in children for p in child.parameters())
        if numel > best_numel:
            best_numel = numel
            best = [f"{path}.{name}" if path else name for name, _ in children]
    return best
