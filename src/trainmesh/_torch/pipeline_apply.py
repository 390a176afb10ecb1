"""``apply_pipeline``: split, then lay out / checkpoint / shard each stage, then build the runner.

Called by ``parallelize`` when the distribution has a ``pipeline`` over an axis of size > 1.
The order, and why:

1. check everything that can be checked locally (ZeRO stage, layouts naming the pipe axis,
   split points, microbatches), before any collective;
2. broadcast the whole model from the first process, then split it: every stage copy starts
   from one source of truth, as DDP's replicas do, so a pipeline run equals one process;
3. find the weights the first and last stage share (a tied embedding and head) while the
   model is still whole: after the split they are two copies whose gradients must be summed;
4. ``apply_layers`` on each stage copy: tensor layout, activation checkpointing, FSDP2 over the
   batch axis (torchtitan's order inside a stage);
5. the runner (torch's ``PipelineStage`` + schedule), whose entry hooks go in last, in front
   of FSDP's and checkpointing's.

The module returned holds this process's parameters under their global names (one stage copy,
or several merged for interleaved schedules); the runner hangs on it as ``_trainmesh_pipeline``.
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist
from torch import nn

from trainmesh import runtime

from .materialize import has_meta_tensors
from .mesh import to_torch_mesh
from .pipeline_experts import check_aux_loss, expert_layers
from .pipeline import PipelineRunner, plan_split, split_for_pipeline, stage_owner
from .pipeline_frozen import trainable_tied
from .pipeline_split import merge_stage_models


def _check(model: nn.Module, distribution, options) -> None:
    pipeline = distribution.pipeline
    mesh = distribution.device_mesh
    if pipeline.axis not in mesh.axis_names:
        raise ValueError(
            f"The pipeline axis {pipeline.axis!r} is not an axis of the mesh {mesh.axis_names}. "
            f"Received: Pipeline(axis={pipeline.axis!r})"
        )
    if pipeline.axis == distribution.batch_dim_name:
        raise ValueError(f"The pipeline axis cannot also be the batch axis. Received: axis={pipeline.axis!r}")
    if options.zero_stage == 1:
        raise ValueError(
            "A pipeline shards optimizer state with its parameters at ZeRO stages 2-3 (FSDP2 over the "
            "batch axis of each stage); stage 1 alone is not offered there. Received: zero_stage=1"
        )
    check_aux_loss(model, pipeline.axis)
    layout_map = getattr(distribution, "layout_map", None)
    if layout_map is not None:
        from .tensor_parallel import _warn_unmatched_keys

        _warn_unmatched_keys(model, distribution)  # on the whole model: a stage holds some layers only
        for path, param in model.named_parameters():
            layout = layout_map[path]
            if layout is not None and pipeline.axis in layout.axes:
                raise ValueError(
                    f"Parameter {path!r} is laid out over the pipeline axis {pipeline.axis!r}; stages "
                    f"hold whole layers. Received: layout {layout.axes}"
                )


def _broadcast_whole_model(model: nn.Module) -> None:
    from .tensor_parallel import _broadcast_from_first

    _broadcast_from_first(model)


def _tied_names(model: nn.Module) -> list[list[str]]:
    """Names of each parameter that has more than one (``tok_emb.weight`` and ``head.weight``)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _tied_groups(stage_models: list[nn.Module], tied: list[list[str]], torch_mesh, pipeline, pipe_size: int):
    """For each weight tied across stages: the pipe-axis group of its two holders (None when this process
    holds both) and this process's copies. Every process creates every group (new_group is collective)."""
    num_stages = pipeline.num_stages(pipe_size)
    first, last = (
        stage_owner(0, pipe_size, pipeline.schedule),
        stage_owner(num_stages - 1, pipe_size, pipeline.schedule),
    )
    axis = torch_mesh.mesh_dim_names.index(pipeline.axis)
    ranks = torch_mesh.mesh.movedim(axis, -1).reshape(-1, pipe_size)  # one row per (other coordinates)
    my_group = None
    if first != last and tied:
        for row in ranks.tolist():
            group = dist.new_group([row[first], row[last]], timeout=runtime.collective_timeout())
            if dist.get_rank() in (row[first], row[last]):
                my_group = group
    out = {}
    for names in tied:
        copies = []
        for stage in stage_models:
            params = dict(stage.named_parameters(remove_duplicate=False))
            found = [params[n] for n in names if n in params]
            if found:
                copies.append(found[0])
        held_by = {id(p) for p in copies}
        if copies and (len(held_by) > 1 or first != last):
            out[names[0]] = (my_group if first != last else None, copies)
    return out


def apply_pipeline(
    model: nn.Module, distribution, options, apply_layers: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    pipeline = distribution.pipeline
    _check(model, distribution, options)  # 1.
    torch_mesh = to_torch_mesh(distribution.device_mesh)
    pipe_size = distribution.device_mesh.axis_size(pipeline.axis)
    pipe_rank = torch_mesh.get_local_rank(pipeline.axis)
    pipeline.validate(pipe_size)
    device = runtime.local_torch_device()
    meta = has_meta_tensors(model)  # a meta-built stage is filled after its layout (materialize.py)
    if not meta:
        model.to(device)
    tied = _tied_names(model)  # 3. (before the split)
    trainable = trainable_tied(model, tied)  # a frozen tied weight has no gradients to sum (pipeline_frozen)
    plan = plan_split(model, pipeline, pipe_size)  # raises on a bad split, before any collective
    experts = expert_layers(model, distribution)  # every stage's, for the Trainer's expert counts
    if not meta:
        _broadcast_whole_model(model)  # 2.
    indices, stage_models = split_for_pipeline(model, pipeline, pipe_rank, pipe_size, plan)
    del model
    stage_models = [apply_layers(stage) for stage in stage_models]  # 4.
    groups = _tied_groups(stage_models, trainable, torch_mesh, pipeline, pipe_size)
    data_axis = distribution.batch_dim_name
    data_group = torch_mesh.get_group(data_axis) if data_axis and torch_mesh.ndim > 1 else None
    data_size = distribution.data_parallel_size
    if getattr(distribution, "sequence", None) is not None:  # a sequence axis: gradients averaged over data x seq
        from .context_parallel import gradient_group

        data_group, data_size = gradient_group(torch_mesh, distribution)
    runner = PipelineRunner(
        stage_models,
        indices,
        pipeline,
        pipe_group=torch_mesh.get_group(pipeline.axis),
        data_group=data_group,
        data_size=data_size,
        reduce_data_grads=options.zero_stage < 2,
        tied_groups=groups,
        device=device,
    )
    runner.batch_axis, runner.expert_layers = data_axis, experts  # pipeline_experts
    runner.install_hooks()  # 5.
    _mark_replicas(runner, groups, pipe_size)
    merged = merge_stage_models(stage_models)
    merged._trainmesh_pipeline = runner
    runner.root = merged
    runner.aliases = _aliases(merged, tied)
    runner.tied_names = tied  # the whole model's names of each tied weight (pipeline_state)
    merged._trainmesh_memory = {"zero_stage": options.zero_stage, "cpu_offload": "off"}
    return merged


def _aliases(merged: nn.Module, tied: list[list[str]]) -> dict[str, str]:
    """Local name -> the whole model's first name, for tied weights held here under another name only."""
    local = {name for name, _ in merged.named_parameters()}
    out = {}
    for names in tied:
        held = [n for n in names if n in local]
        if len(held) == 1 and held[0] != names[0]:
            out[held[0]] = names[0]
    return out


def _mark_replicas(runner: PipelineRunner, groups: dict, pipe_size: int) -> None:
    """On how many processes each parameter's value lives, for the global gradient norm: the job over
    the pipeline's size (a stage's processes), twice for a weight held by the first and last stage."""
    world = dist.get_world_size()
    tied = {id(p) for _, copies in groups.values() for p in copies}
    for param in runner.parameters():
        param._trainmesh_replica_world = (world // pipe_size) * (2 if id(param) in tied else 1)
