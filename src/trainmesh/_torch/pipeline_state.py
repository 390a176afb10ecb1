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


def _stage_order(runner) -> dict[str, int]:
    """Local name -> the index of the stage holding it, to order the merged lists as the unpiped model."""
    order: dict[str, int] = {}
    for index, stage in zip(runner.indices, runner.stage_models):
        for name, _ in stage.named_parameters(remove_duplicate=False):
            order.setdefault(name, index)
    return order


def pipeline_full_optimizer_state(model: nn.Module, optimizer) -> dict[str, Any]:
    """Every stage's optimizer state, FQN-keyed as ``get_optimizer_state_dict(full_state_dict=True)``
    gives it, on the main process; ``{}`` elsewhere. A tied head's copy (the last stage's, updated
    as the embedding's) is left out: one process holds that state once, under the embedding's name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    runner = model._trainmesh_pipeline
    keep = _sender(runner)
    local = get_optimizer_state_dict(model, optimizer)
    state = {fqn: {k: _whole(v, keep) for k, v in values.items()} for fqn, values in local["state"].items()}
    order = _stage_order(runner)
    part = {"state": state, "param_groups": local["param_groups"], "order": order}
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    parts = _to_main(part if keep else None)
    if not parts:
        return {}
    stage_of: dict[str, int] = {}
    for part in parts:
        stage_of.update(part["order"])
    for part in parts:
        merged["state"].update(part["state"])
        for index, group in enumerate(part["param_groups"]):
            if index == len(merged["param_groups"]):
                merged["param_groups"].append({**group, "params": []})
            merged["param_groups"][index]["params"].extend(group["params"])
    # a tied head's copy goes where the embedding's state is held too (its twin: the same updates);
    # under ZBV one process holds both copies, each with its own state
    held = {fqn for group in merged["param_groups"] for fqn in group["params"]}
    dropped = {name for names in _tied(runner) if names[0] in held for name in names[1:]}
    for fqn in dropped:
        merged["state"].pop(fqn, None)
    for group in merged["param_groups"]:
        group["params"] = sorted((p for p in group["params"] if p not in dropped), key=lambda p: stage_of.get(p, 0))
    return merged


def local_model_state(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The entries of a whole model's state this process's stages hold (a strict load then still
    names what the state lacks)."""
    held = set(get_model_state_dict(model))
    return {name: value for name, value in state.items() if name in held}


def local_optimizer_state(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A whole model's optimizer state with a tied head's entry added under the name this process
    holds it by (the state has it under the embedding's name only); torch's loader takes the rest
    of what this process's parameters need and ignores the other stages' entries."""
    tied = _tied(model._trainmesh_pipeline)
    if not tied:
        return state
    entries = dict(state.get("state", {}))
    groups = [dict(group, params=list(group["params"])) for group in state.get("param_groups", [])]
    for canonical, *others in tied:
        for group in groups:
            for other in others:
                if canonical in group["params"] and other not in group["params"]:
                    group["params"].append(other)
                    if canonical in entries:
                        entries[other] = entries[canonical]
    return {**state, "state": entries, "param_groups": groups}


def _tied(runner) -> list[list[str]]:
    """Each tied weight's names in the whole model, the first being the one a one-process optimizer
    state keys it by."""
    return [list(names) for names in getattr(runner, "tied_names", None) or []]
