"""What ``CheckpointManager`` does with each entry of the ``state`` dict it is given: the model, the
optimizer, per-rank state, shared state or a plain value; and the layout recorded in the marker.

It exists apart from ``manager.py`` because save and load sort ``state`` the same way: one place
says which key goes to which file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# State that differs per rank: its sampler cursor / worker state, its compressor's error-feedback
# residuals. An object with ``load_resharded_state(states)`` gets every saved rank's state when
# the world size changed (residuals are redistributed, not taken from one rank).
PER_RANK_KEYS = ("data", "compression")


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _split(state: dict[str, Any]):
    """-> (model, optimizer, per-rank stateful, shared stateful, plain values)."""
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict of stateful objects and plain values. Received: {type(state).__name__}")
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    optims = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    if len(modules) > 1 or len(optims) > 1:
        raise ValueError(
            f"A checkpoint holds one model and one optimizer. Received modules={modules}, optimizers={optims}"
        )
    model = state[modules[0]] if modules else None
    optimizer = state[optims[0]] if optims else None
    if optimizer is not None and model is None:
        raise ValueError("state has an optimizer but no nn.Module: the optimizer state is keyed by the model's FQNs.")
    per_rank, shared, plain = {}, {}, {}
    for key, value in state.items():
        if key in modules or key in optims or value is None:
            continue
        target = (per_rank if key in PER_RANK_KEYS else shared) if _is_stateful(value) else plain
        target[key] = value
    return model, optimizer, per_rank, shared, plain


def _layout_info(model: nn.Module | None, optimizer: Any) -> dict[str, Any]:
    memory = {}
    for module in model.modules() if model is not None else ():
        memory = getattr(module, "_trainmesh_memory", None) or memory
        if memory:
            break
    return {
        "zero_stage": memory.get("zero_stage", 1 if type(optimizer).__name__ == "ZeroRedundancyOptimizer" else 0),
        "model_class": type(model).__name__ if model is not None else None,
        "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
    }
