"""The full state of a pipelined model on the main process: every stage's tensors, gathered.

Under a pipeline each process holds only its own stages (``pipeline_apply``), so torch's
``get_model_state_dict(full_state_dict=True)`` returns, on the main process, stage 0 alone and
nothing anywhere else. ``Trainer.state_dict()`` promises the whole model on the main process, as
under ZeRO: here each stage gathers its sharded tensors (DTensors over its data and model axes)
one at a time, and one process per stage sends its stage's whole tensors to the main process.

Names are already global (a stage holds its layers under the whole model's names), so the merged
dict loads into a one-process model with ``load_state_dict``. A weight tied between the first and
last stage (embedding and head) appears under both names, as in the unpiped model's state dict.
Every process must call these together.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict


def is_pipelined(model: nn.Module) -> bool:
    return getattr(model, "_trainmesh_pipeline", None) is not None


def _whole(value: Any, keep: bool) -> Any:
    """The whole value of one tensor on CPU where ``keep``, else None. Collective for a DTensor (its
    mesh is the stage's: every process of the stage takes part, in the same key order)."""
    if not isinstance(value, torch.Tensor):
        return value if keep else None
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.detach().to("cpu", copy=True) if keep else None


def _sender(runner) -> bool:
    """Whether this process sends its stages' tensors: the lowest global rank of its pipe rank (every
    process of a stage holds the same whole tensors once gathered; one copy is enough)."""
    pipe_ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(pipe_ranks, runner.pipe_rank)
    return pipe_ranks.index(runner.pipe_rank) == dist.get_rank()


def _to_main(part: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every sender's dict on the main process (an empty list elsewhere)."""
    main = dist.get_rank() == 0
    parts: list | None = [None] * dist.get_world_size() if main else None
    dist.gather_object(part, parts, dst=0)
    return [p for p in parts if p is not None] if main else []


def pipeline_full_model_state(model: nn.Module) -> dict[str, Any]:
    """Every stage's whole tensors under their global names on the main process; ``{}`` elsewhere."""
    keep = _sender(model._trainmesh_pipeline)
    local = {name: _whole(value, keep) for name, value in get_model_state_dict(model).items()}
    merged: dict[str, Any] = {}
    for part in _to_main(local if keep else None):
        merged.update(part)
    return merged
