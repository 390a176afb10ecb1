"""Sharded model + optimizer state through ``torch.distributed.checkpoint`` (DCP).

``get_state_dict`` hands out each process's own shards (DTensor for FSDP2 / tensor
parallel, plain tensors for DDP) under unwrapped FQNs, so a checkpoint written by one
layout loads into another: DCP matches saved chunks to the requested shards by global
offsets. ``ZeroRedundancyOptimizer`` (ZeRO stage 1) is the one optimizer torch's helpers do
not know; its state is consolidated on rank 0 into the same FQN-keyed format a plain
optimizer produces, and loaded back from full tensors (``_load_state_dict_from_keys``).

Every function here is collective over ``process_group`` (all ranks call it together).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .zero_optimizer import full_state, is_zero_optimizer, load_full_state


def new_checkpoint_group():
    """A gloo group for checkpoint collectives (collective: every rank calls it).

    Async saves plan and gather results from a background thread; on the default group
    those collectives could interleave with the training step's own and deadlock, which
    torch's docs warn about. gloo also gives DCP the CPU backend it requires under NCCL.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo")


def sharded_state(model: nn.Module, optimizer: Any | None) -> dict[str, Any]:
    """This rank's shards of model (+ optimizer) state, keyed ``model`` / ``optimizer``."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is None:
        return state
    if is_zero_optimizer(optimizer):
        # Replicated parameters, sharded optimizer: gather once on rank 0, which alone writes it.
        full = full_state(model, optimizer)
        if full:
            state["optimizer"] = full
    else:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def save(state: dict[str, Any], path: str, process_group=None) -> None:
    dcp.save(state, checkpoint_id=path, process_group=process_group)


def async_save(state: dict[str, Any], path: str, process_group=None) -> Future:
    """Stage a CPU copy now (the only blocking part), write it in a background thread."""
    result = dcp.async_save(state, checkpoint_id=path, process_group=process_group)
    return getattr(result, "upload_completion", result)


def load_sharded(model: nn.Module, optimizer: Any | None, path: str, process_group=None) -> None:
    """Load a DCP checkpoint into ``model`` / ``optimizer`` as they are laid out *now*.

    The templates come from the current model, so DCP reads exactly this rank's shards
    (resharding from any world size, ZeRO stage or mesh the checkpoint was written with).
    """
    if optimizer is not None and is_zero_optimizer(optimizer):
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path, process_group=process_group)
        set_model_state_dict(model, state["model"])
        # No template to read shards into: the optimizer state arrives as full tensors.
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        loaded = _load_state_dict_from_keys({"optimizer"}, checkpoint_id=path, process_group=process_group)
        load_full_state(model, optimizer, loaded["optimizer"])
        return
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path, process_group=process_group)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def full_model_state_on_rank0(model: nn.Module) -> dict[str, Any]:
    """The whole unwrapped model state, gathered to CPU (every rank calls; rank 0 keeps it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: nn.Module, state: dict[str, Any], *, strict: bool = True) -> None:
    """Full tensors (present on every rank) -> this rank's shards of ``model``."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))
