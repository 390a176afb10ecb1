"""What the Trainer's constructor checks and binds: the distribution it runs on, and the optimizer
pointed at the parameters the distribution laid out (which may be new objects: DTensor, a pipeline
stage's copies)."""

from __future__ import annotations

from typing import Any

import torch

from trainmesh._torch.sync import unwrap
from trainmesh.distribution import DataParallel, Distribution, distribution as current_distribution


def resolve_distribution(distribution: Any) -> Distribution:
    if distribution is None:
        distribution = current_distribution() or DataParallel()
    distribution = getattr(distribution, "distribution", distribution)  # a Strategy adapts a Distribution
    if not isinstance(distribution, Distribution):
        raise TypeError(f"distribution must be a trainmesh Distribution or Strategy. Received: {distribution!r}")
    return distribution


def bind_optimizer(
    optimizer: Any,
    model: torch.nn.Module,
    distribution: Distribution,
    names_before: dict[int, str],
    canonical: dict[str, str],
) -> torch.optim.Optimizer:
    """The optimizer over ``model``'s parameters as ``distribution`` laid them out: built from the
    trainable ones when ``optimizer`` is a callable, else the given one's groups rebound by name
    (``names_before``: the parameters' names before the layout; ``canonical``: every name -> its first)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(
                f"optimizer must be a torch Optimizer or a callable params -> Optimizer. Received: {optimizer!r}"
            )
        # Frozen parameters (``requires_grad=False``: a fine-tuned base under LoRA) get no optimizer
        # state and, under ZeRO-1, no partition or broadcast: the optimizer sees the trainable ones.
        trainable = [p for p in model.parameters() if p.requires_grad]
        return distribution.prepare_optimizer(optimizer(trainable), model)
    # A distribution may replace parameters (DTensor); point the optimizer at the new ones. A pipeline
    # stage holds some of them only (under any of their names: a tied head's weight on the last stage).
    pipelined = getattr(model, "_trainmesh_pipeline", None) is not None
    new_by_name: dict[str, list] = {}
    for name, param in unwrap(model).named_parameters():
        new_by_name.setdefault(canonical.get(name, name) if pipelined else name, []).append(param)
    for group in optimizer.param_groups:
        rebound = []
        for param in group["params"]:
            name = names_before.get(id(param))
            if name is None or (name not in new_by_name and not pipelined):
                raise ValueError(
                    "The optimizer holds parameters that are not the model's. Build it from "
                    "model.parameters(), or pass a callable params -> optimizer."
                )
            rebound.extend(new_by_name.get(name, []))
        if any(p is not q for p, q in zip(group["params"], rebound)) and optimizer.state:
            raise ValueError("The optimizer already has state; pass a fresh one (or a callable) to the Trainer.")
        group["params"] = rebound
    return distribution.prepare_optimizer(optimizer, model)  # ZeRO-1 shards its state
