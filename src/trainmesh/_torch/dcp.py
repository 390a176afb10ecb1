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

import datetime
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .dcp_reader import SafeFileSystemReader
from .trainable_state import check_same_trainable, model_state
from .zero_optimizer import full_state, is_zero_optimizer, load_full_state


def new_checkpoint_group():
    """A gloo group for checkpoint collectives (collective: every rank calls it).

    Async saves plan and gather results from a background thread; on the default group
    those collectives could interleave with the training step's own and deadlock, which
    torch's docs warn about. gloo also gives DCP the CPU backend it requires under NCCL.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    from .. import runtime

    # Bounded, so a dead rank surfaces; but at least 10 minutes, since peers legitimately wait
    # while rank 0 hashes a multi-GB checkpoint or a slow rank finishes its write.
    timeout = max(runtime.collective_timeout(), datetime.timedelta(minutes=10))
    return dist.new_group(backend="gloo", timeout=timeout)


def sharded_state(model: nn.Module, optimizer: Any | None, *, frozen: bool = True) -> dict[str, Any]:
    """This rank's shards of model (+ optimizer) state, keyed ``model`` / ``optimizer``; without
    the frozen parameters for ``frozen=False`` (see :mod:`.trainable_state`)."""
    state: dict[str, Any] = {"model": model_state(model, frozen=frozen)}
    if optimizer is not None and not is_zero_optimizer(optimizer):
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    pipelined = getattr(model, "_trainmesh_pipeline", None) is not None  # ranks hold different keys
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not pipelined:
        # Before the ZeRO-1 part is added: that one exists on rank 0 only, so splitting it
        # would give ranks different views of what is shared.
        _keep_owned_replicas(state, dist.get_rank(), dist.get_world_size())
    if optimizer is not None and is_zero_optimizer(optimizer):
        # Replicated parameters, sharded optimizer: gather once on rank 0, which alone writes it.
        full = full_state(model, optimizer)
        if full:
            state["optimizer"] = full
    return state


_MIN_SPLIT_NUMEL = 4096  # smaller tensors stay on every rank: not worth the bookkeeping


def _keep_owned_replicas(state: dict[str, Any], rank: int, world_size: int) -> None:
    """Drop (from copies of the dicts) the replicated, non-DTensor tensors another rank writes.

    DCP keeps one copy of a tensor every rank holds anyway (it treats plain tensors as
    replicas); deciding the owner here, balanced by bytes, means each rank also *stages*
    (async) and plans only ~1/N of the replicated state: DDP's whole model + optimizer.
    The assignment depends only on keys and sizes, identical on every rank. The dicts are
    copied, never edited: ``get_optimizer_state_dict`` hands out the optimizer's own ones.
    """
    entries = []

    def visit(container, path):
        for key, value in container.items():
            if isinstance(value, dict):
                visit(value, path + (str(key),))
            elif (
                isinstance(value, torch.Tensor) and not hasattr(value, "to_local") and value.numel() >= _MIN_SPLIT_NUMEL
            ):
                entries.append((value.numel() * value.element_size(), path + (str(key),)))

    visit(state, ())
    loads, dropped = [0] * world_size, set()
    for size, path in sorted(entries, key=lambda e: (-e[0], e[1])):
        owner = loads.index(min(loads))  # greedy: largest first onto the least-loaded rank
        loads[owner] += size
        if owner != rank:
            dropped.add(path)

    def pruned(container, path):
        return {
            key: pruned(value, path + (str(key),)) if isinstance(value, dict) else value
            for key, value in container.items()
            if path + (str(key),) not in dropped
        }

    state.update(pruned(state, ()))
    for key in [k for k in state if (str(k),) in dropped]:
        del state[key]


def _no_dist() -> bool:
    # One process without a group: say so, rather than have DCP warn that it assumed it.
    return not (dist.is_available() and dist.is_initialized())


def save(state: dict[str, Any], path: str, process_group=None) -> None:
    dcp.save(state, checkpoint_id=path, process_group=process_group, no_dist=_no_dist())


class ReusableStager(BlockingAsyncStager):
    """Stages into CPU buffers kept between saves: after the first save, staging is a copy
    into memory already allocated (no page faults), which is most of ``save()``'s blocking
    time. Costs one extra CPU copy of this rank's state for the run's lifetime. The buffers
    are rebuilt when the state's structure changes (keys, shapes, dtypes)."""

    def __init__(self):
        super().__init__(cache_staged_state_dict=True)
        self._signature = None

    def stage(self, state_dict):
        signature = _signature(state_dict)
        if signature != self._signature or self.state_dict_cache is None:
            # Pinned memory speeds device-to-host copies, and only exists with an accelerator.
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._signature = signature
        return _copy_state_dict(state_dict, self.state_dict_cache)


def _signature(obj) -> Any:
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return (type(obj).__name__, tuple(obj.shape), tuple(local.shape), obj.dtype)
    return type(obj).__name__


def async_save(state: dict[str, Any], path: str, process_group=None, stager=None) -> Future:
    """Stage a CPU copy now (the only blocking part), write it in a background thread."""
    result = dcp.async_save(
        state, checkpoint_id=path, process_group=process_group, no_dist=_no_dist(), async_stager=stager
    )
    return getattr(result, "upload_completion", result)


def _safe_reader(path: str) -> SafeFileSystemReader:
    # Metadata read here first: a refused file raises its own error on every rank, before DCP's
    # collectives (which would fall back to per-rank metadata and report an AssertionError).
    reader = SafeFileSystemReader(path)
    reader.read_metadata()
    return reader


def load_sharded(
    model: nn.Module, optimizer: Any | None, path: str, process_group=None, *, trainable_only: list[str] | None = None
) -> None:
    """Load a DCP checkpoint into ``model`` / ``optimizer`` as they are laid out *now*.

    The templates come from the current model, so DCP reads exactly this rank's shards
    (resharding from any world size, ZeRO stage or mesh the checkpoint was written with).
    ``trainable_only``: the model keys of a checkpoint saved without its frozen parameters; the
    model's trainable set is checked against them first, and its frozen ones keep their values.
    Nothing in the directory runs code: see :mod:`.dcp_reader`.
    """
    frozen = trainable_only is None
    if not frozen:
        check_same_trainable(model, trainable_only, path, process_group)
    # strict=False for a trainable-only one: the frozen parameters are absent on purpose (checked above).
    options = StateDictOptions(strict=frozen)
    if optimizer is not None and is_zero_optimizer(optimizer):
        state = {"model": model_state(model, frozen=frozen)}
        dcp.load(
            state,
            checkpoint_id=path,
            storage_reader=_safe_reader(path),
            process_group=process_group,
            no_dist=_no_dist(),
        )
        set_model_state_dict(model, state["model"], options=options)
        # No template to read shards into: the optimizer state arrives as full tensors.
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        loaded = _load_state_dict_from_keys(
            {"optimizer"}, checkpoint_id=path, process_group=process_group, storage_reader=_safe_reader(path)
        )
        load_full_state(model, optimizer, loaded["optimizer"])
        return
    state = {"model": model_state(model, frozen=frozen)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        own_groups = [list(group["params"]) for group in state["optimizer"]["param_groups"]]
        aliases = _rename_state(state["optimizer"], _aliases(model))
    dcp.load(
        state, checkpoint_id=path, storage_reader=_safe_reader(path), process_group=process_group, no_dist=_no_dist()
    )
    set_model_state_dict(model, state["model"], options=options)
    if optimizer is not None:
        _rename_state(state["optimizer"], aliases)
        # The saved param groups list the parameters of whichever process wrote them (under a pipeline,
        # one stage's); the hyper-parameters carry over, the names must be this model's own.
        loaded_groups = state["optimizer"]["param_groups"]
        if len(loaded_groups) == len(own_groups):
            for group, names in zip(loaded_groups, own_groups):
                group["params"] = names
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _aliases(model: nn.Module) -> dict[str, str]:
    """A pipeline's last stage holds a tied head's weight under the head's name; checkpoints of the
    whole model keep its optimizer state under the embedding's (the parameter's first name)."""
    runner = getattr(model, "_trainmesh_pipeline", None)
    return dict(getattr(runner, "aliases", {}) or {})


def _rename_state(optimizer_state: dict, renames: dict[str, str]) -> dict[str, str]:
    """Rename optimizer-state keys in place; returns the reverse mapping."""
    states = optimizer_state.get("state", {})
    for old, new in renames.items():
        if old in states and new not in states:
            states[new] = states.pop(old)
    return {new: old for old, new in renames.items()}


def full_model_state_on_rank0(model: nn.Module) -> dict[str, Any]:
    """The whole unwrapped model state, gathered to CPU (every rank calls; rank 0 keeps it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: nn.Module, state: dict[str, Any], *, strict: bool = True) -> None:
    """Full tensors (present on every rank) -> this rank's shards of ``model``."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))
