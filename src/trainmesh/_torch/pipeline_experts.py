"""Expert parallelism inside pipeline stages: what the runner does differently for a stage's experts.

A stage's MoE layers have their experts split over the stage's processes of the expert axis, and the
dispatch (``expert_parallel``) sends tokens within that group only, so it runs as it does without a
pipeline: every process of a stage runs the same schedule, hence the same sequence of all-to-alls.
Three things differ from the dense parameters around them:

* gradients. After a schedule the runner averages a stage's gradients over the batch axis. An expert
  laid out over the batch axis is a *different* expert on each process of it, and its gradient already
  arrives whole from the dispatch's backward (summed over the processes whose tokens it computed, times
  1/EP): averaging it with its neighbours' would mix experts. It is left out of that average
  (``data_averaged``), and where EP is smaller than the batch axis it is averaged over the processes
  holding the same experts only (``average_expert_replicas``), as ``DataAxisGradReducer`` does without a
  pipeline. Experts over another axis (a model axis) are the same expert across the batch axis and stay
  in the average;
* torch's schedules infer the stages' shapes by one forward and backward on uninitialised tensors at the
  first step (``_forward_metadata_inference``); the tokens routed there are not training tokens, so the
  Trainer's per-expert counts skip them (``not_counted``);
* the auxiliary load-balancing loss is refused (``check_aux_loss``): it is one function of every layer's
  router logits over the whole batch, but a stage holds some layers and a schedule step one microbatch,
  and the stages pass one activation tensor, so the loss could reach the last stage neither whole nor
  with one process's gradient. Dropping it silently would train another model.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch import nn


def _experts(model: nn.Module) -> list[nn.Parameter]:
    """A stage's expert parameters, found by their modules: the stage's ``model.to(device)`` swaps each
    DTensor parameter's contents, its ``__dict__`` (the ``_trainmesh_expert`` mark) included."""
    plan = getattr(model, "_trainmesh_expert_plan", None)
    if plan is None:
        return []
    return [getattr(model.get_submodule(m.path), name) for m in plan.modules for name in m.param_names]


def _batch_axis_experts(stage_models: list[nn.Module], batch_axis: str | None) -> set[int]:
    out: set[int] = set()
    for model in stage_models:
        plan = getattr(model, "_trainmesh_expert_plan", None)
        if plan is not None and plan.axis == batch_axis:
            out.update(id(p) for p in _experts(model))
    return out


def data_averaged(
    stage_models: list[nn.Module], params: list[nn.Parameter], batch_axis: str | None
) -> list[nn.Parameter]:
    """``params`` less the experts laid out over ``batch_axis`` (see the module docstring)."""
    experts = _batch_axis_experts(stage_models, batch_axis)
    return [p for p in params if id(p) not in experts] if experts else params


def average_expert_replicas(stage_models: list[nn.Module]) -> None:
    """EP smaller than the batch axis at ZeRO 0: each expert's gradient averaged over the processes that
    hold it (at ZeRO 2-3 their own FSDP2 unit does it). One flattened all-reduce per stage and dtype."""
    from .pipeline import _average_grads

    for model in stage_models:
        mesh = getattr(model, "_trainmesh_expert_replica_mesh", None)
        if mesh is None:
            continue
        _average_grads(_experts(model), mesh.get_group(), dist.get_world_size(mesh.get_group()))


def expert_layers(model: nn.Module, distribution) -> list[tuple[str, int]]:
    """The whole model's experts modules laid out over an axis (path, number of experts), in module order,
    before the split: the
    Trainer's per-expert counts are laid out over all of them on every process (``trainer/expert_load.py``),
    whichever stage holds each. Local (the layout's own checks, no collective)."""
    from trainmesh.distribution.expert_layout import build_expert_plan

    plan = build_expert_plan(model, distribution) if getattr(distribution, "layout_map", None) else None
    return [(experts.path, experts.num_experts) for experts in plan.modules] if plan is not None else []


@contextlib.contextmanager
def not_counted(stage_model: nn.Module):
    """The dispatches inside run without adding to the Trainer's per-expert token counts."""
    from .expert_parallel import dispatch_states

    states = [state for _, state in dispatch_states(stage_model)]
    saved = [state.train_tokens.clone() for state in states]
    try:
        yield
    finally:
        for state, tokens in zip(states, saved):
            state.train_tokens.copy_(tokens)


def check_aux_loss(model: nn.Module, pipe_axis: str) -> None:
    """ValueError, before any collective, for a model asked to return its router logits under a pipeline
    (the auxiliary loss; see the module docstring)."""
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "output_router_logits", False):
            coef = getattr(config, "router_aux_loss_coef", None)
            raise ValueError(
                f"The auxiliary load-balancing loss is not offered with a pipeline over {pipe_axis!r}: it is one "
                f"function of every MoE layer's router logits over the whole batch, and pipeline stages hold "
                f"some layers and run one microbatch at a time, passing one activation tensor on, so it "
                f"would be dropped or computed on a part of the batch. Set output_router_logits=False in "
                f"{type(config).__name__} (the cross-entropy alone trains), or train without the pipeline "
                f"axis (trainmesh.moe.load_balancing_loss then gives one process's value). Received: "
                f"{path or type(module).__name__}.config.output_router_logits=True, router_aux_loss_coef={coef}"
            )
