"""What one pipeline stage runs, and torch's ``PipelineStage`` around it.

``StageModule`` adapts a stage copy of the user's model to what torch's schedules call: a
tensor in (token ids on the first stage, the previous stage's activation elsewhere) and a tensor
out. ``make_pipeline_stage`` builds torch's stage over it so that torch's data-parallel handling
still applies: torch recognises FSDP only when the stage's module *is* the FSDP module, and
ours wraps it. Without that, FSDP2 reduce-scatters gradients after every microbatch's backward
(m times per step); with it, gradients accumulate unsharded across the microbatches and are
reduce-scattered once, after the last (torch's ``perform_reduce_grad``), as torchtitan runs PP x FSDP.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from .pipeline_inputs import stage_inputs
from .pipeline_output import split_output
from .pipeline_split import KeyedBlocks
from .pipeline_zero_bubble import not_a_view


class StageModule(nn.Module):
    """What torch's ``PipelineStage`` runs: the stage copy's own forward, with the received
    activation put in place of its first block's input, and a tensor out (not a model output).
    ``model_output`` rebuilds the model's own output type around such a tensor (``pipeline_output``)."""

    def __init__(self, stage_model: nn.Module, is_first: bool, forward_context: Callable):
        super().__init__()
        self.stage_model = stage_model
        self.is_first = is_first
        self.forward_context = forward_context
        self._incoming: list[torch.Tensor] = []
        self.dict_inputs = False  # set by the runner per step: the user's batch is a dict (pipeline_inputs)
        self.model_output: Callable[[torch.Tensor], Any] = lambda tensor: tensor  # set by each forward

    def install_entry_hook(self) -> None:
        """Last of all (after checkpointing and FSDP wrap the blocks), and ahead of their hooks, so the
        substitution happens outside any recomputed region and before FSDP sees the arguments."""
        if self.is_first:
            return
        blocks = _blocks_of(self.stage_model)
        first = next(iter(blocks))

        def substitute(module, args, kwargs):
            if not self._incoming:
                return None
            x = self._incoming.pop()
            if args:
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}

        first.register_forward_pre_hook(substitute, with_kwargs=True, prepend=True)

    def forward(self, x: torch.Tensor, **side: torch.Tensor) -> torch.Tensor:
        """``x``: the token ids (first stage) or the received activation; ``side``: this microbatch's
        attention_mask / position_ids, which torch's schedule hands every stage (``pipeline_inputs``)."""
        if isinstance(self.stage_model, KeyedBlocks):  # an nn.Sequential model: a plain chain
            with self.forward_context():
                for block in self.stage_model:
                    x = block(x)
            return not_a_view(x)
        if self.is_first:
            ids = x
        else:
            ids = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
            self._incoming.append(x)
        try:
            with self.forward_context():
                out = self.stage_model(stage_inputs(ids, side, self.dict_inputs))
        finally:
            self._incoming.clear()
        tensor, self.model_output = split_output(out)
        return not_a_view(tensor)


def _blocks_of(stage_model: nn.Module) -> KeyedBlocks:
    if isinstance(stage_model, KeyedBlocks):
        return stage_model
    container = stage_model._trainmesh_stage[2]
    return stage_model.get_submodule(container)


def make_pipeline_stage(module: StageModule, index: int, num_stages: int, device: torch.device, group):
    """torch's ``PipelineStage`` over ``module``, with its FSDP handling reaching the FSDP-wrapped
    stage model inside (see the module docstring)."""
    from torch.distributed.pipelining import PipelineStage

    from .pipeline_experts import not_counted
    from .pipeline_receives import ReceivesPostedAhead

    class _Stage(ReceivesPostedAhead, PipelineStage):
        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
            with _fsdp_seen(self):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

        def perform_reduce_grad(self, grad_scale_factor: int):
            with _fsdp_seen(self):
                return super().perform_reduce_grad(grad_scale_factor)

        def _forward_metadata_inference(self, *args, **kwargs):
            # torch's shape inference runs the stage on uninitialised tensors: not training tokens
            with not_counted(module.stage_model):
                return super()._forward_metadata_inference(*args, **kwargs)

    return _Stage(module, index, num_stages, device, group=group, get_mesh=lambda names, _: _mesh_named(module, names))


def _mesh_named(module: StageModule, names: tuple[str, ...]):
    """The device mesh a received DTensor activation lives on, by its axis names: torch's stage sends a
    DTensor's layout with its mesh's names only. Under sequence parallelism a stage's output is the
    residual stream, a ``Shard(1)`` DTensor on the model axis, and the receiving stage's own parameters
    live on that axis's mesh of its own processes."""
    from torch.distributed.tensor import DTensor

    for param in module.stage_model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            if mesh.mesh_dim_names == tuple(names):
                return mesh
            if mesh.mesh_dim_names and set(names) <= set(mesh.mesh_dim_names):
                return mesh[tuple(names)]
    raise ValueError(
        f"A pipeline stage received a DTensor on a mesh of axes {tuple(names)}, and none of the stage's own "
        f"parameters lives on such a mesh. Received: mesh axes {tuple(names)}"
    )


@contextlib.contextmanager
def _fsdp_seen(stage):
    """Show torch's stage the FSDP module it should manage, for one call. Everything these calls
    read from ``submod`` (its parameters, FSDP's state) is the same object either way: the
    StageModule holds the stage model and nothing else with parameters."""
    from torch.distributed.fsdp import FSDPModule

    outer = stage.submod
    inner = getattr(outer, "stage_model", None)
    if not isinstance(inner, FSDPModule):
        yield
        return
    stage.submod = inner
    try:
        yield
    finally:
        stage.submod = outer
