"""Full (unsharded) state dicts of distributed models and optimizers, and loading them back.

Built on ``torch.distributed.checkpoint.state_dict``, which knows DDP prefixes and gathers
DTensor parameters and optimizer state (FSDP2 included). ``ZeroRedundancyOptimizer`` (ZeRO
stage 1) is the exception torch's helpers do not know: it is consolidated on the main process
first (``zero_optimizer.full_state``) into the same FQN-keyed format. Under a pipeline each
process holds its own stages only, so the stages' states are gathered and loaded apart
(``pipeline_state``). Every process must call these together.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@contextlib.contextmanager
def _quiet_gather() -> Iterator[None]:
    """Gathering a 2-D (ZeRO x tensor-parallel) parameter is two all-gathers by design; DTensor logs
    a performance warning for each, every checkpoint. Quieted for these calls only, then restored:
    the user's own DTensor code keeps torch's logging as it was."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def full_model_state(model: nn.Module) -> dict[str, Any]:
    from .pipeline_state import is_pipelined, pipeline_full_model_state

    if is_pipelined(model):  # torch's gather sees this process's stages only
        with _quiet_gather():
            return pipeline_full_model_state(model)
    with _quiet_gather():
        return get_model_state_dict(model, options=_FULL)


def full_optimizer_state(model: nn.Module, optimizer) -> dict[str, Any]:
    from .pipeline_state import is_pipelined, pipeline_full_optimizer_state
    from .zero_optimizer import full_state, is_zero_optimizer

    if is_pipelined(model):  # no ZeRO-1 under a pipeline (pipeline_apply refuses it)
        with _quiet_gather():
            return pipeline_full_optimizer_state(model, optimizer)
    if is_zero_optimizer(optimizer):
        return full_state(model, optimizer)
    with _quiet_gather():
        return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_full_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    from .pipeline_state import is_pipelined, local_model_state

    if is_pipelined(model):  # the other stages' entries are not this module's keys
        state = local_model_state(model, state)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(model: nn.Module, optimizer, state: dict[str, Any]) -> None:
    from .pipeline_state import is_pipelined, local_optimizer_state
    from .zero_optimizer import is_zero_optimizer, load_full_state

    if is_pipelined(model):
        state = local_optimizer_state(model, state)

    if is_zero_optimizer(optimizer):
        return load_full_state(model, optimizer, state)
    if not state.get("state"):
        # A stateless optimizer (plain SGD): torch's loader cannot place an empty state on a device
        # ("Expected device to be set"); only the hyper-parameters are there to restore.
        for group, saved in zip(optimizer.param_groups, state.get("param_groups", [])):
            group.update({k: v for k, v in saved.items() if k != "params"})
        return None
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
