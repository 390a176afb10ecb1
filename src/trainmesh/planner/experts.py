"""Expert parallelism in a plan: what a process holds of a mixture of experts' expert weights when they
are split over ``expert_parallel_size`` (EP) processes of the batch axis.

The dry run (``dry_run.py``) runs the model's experts as any other layer: replicated over the batch
axis, or, under ZeRO-3, every expert tensor sharded on dim 0 over the whole axis. Under EP
(``LayoutMap.auto(..., expert_axis=<batch axis>, expert_parallel_size=EP)``) a process holds
``num_experts / EP`` whole experts, and ZeRO-3 shards those only over the ``batch / EP`` processes that
hold the same experts (FSDP2's dim-0 shard, the remainder padded: ``ceil(rows / n)`` rows each). The
token dispatch's data-dependent shapes (each step's counts are read on the host) do not run on fake
tensors, so the dry run is not asked to run it: this module replaces the dry run's expert bytes with
EP's, for the parameters, their gradients (same shards, same dtype) and the optimizer's state (the
dry run's own state bytes per parameter byte: 2 for Adam, 1 for SGD with momentum). Dense layers keep
the dry run's figures.

The token dispatch's all-to-alls are added to the rank's collectives at uniform routing (the issue's
formula; real routing is measured by ``benchmarks/moe.py``): per MoE layer one count exchange
(``num_experts`` int64) and four token exchanges (dispatch and combine, forward and backward), each of a
full buffer of ``tokens x top_k x hidden`` activation elements, of which ``(EP-1)/EP`` leave the process
(``collectives.wire_bytes``). They run within the EP group: the batch axis when EP is the whole axis,
otherwise ``<batch>_expert`` (the training run's own name for the group: EP neighbouring processes).

The dry run also reduces the experts' gradients over the whole batch axis, as any replicated (or ZeRO-3
sharded) parameter's. Under EP they are not: each process of an EP group holds other experts, whose
gradients arrive whole from the dispatch's backward. ``expert_gradient_traffic`` takes the experts out of
the batch axis's gradient all-reduce (ZeRO 0) or all-gathers and reduce-scatters (ZeRO-3, where FSDP2
leaves them out), and, where EP is smaller than the axis, adds what the ``batch / EP`` processes holding
the same experts exchange, on ``<batch>_expert_replica``: the all-reduce of their gradients (ZeRO 0), or
their own FSDP2 unit's gathers and reduce-scatter (ZeRO-3). The dry run's counts that this follows,
measured by growing the experts: at ZeRO 0 the expert gradients are all-reduced once per step; at ZeRO-3
they are gathered ``microbatches + 1`` times (each microbatch's forward, then once for the whole backward;
1 + 1 without a pipe) and reduce-scattered once.

With a pipe axis (pipe x EP), a process holds the MoE layers of its stages only: the experts and the
all-to-alls counted are those of the layers in the rank's stages, found by the same split the pipeline
applies (``_torch.pipeline.plan_split``: the repeated blocks balanced by parameters, or the split points),
each stage's experts split over EP processes of the batch axis as without a pipe. The traffic is per
microbatch, times the step's microbatches (the dry run's ``microbatches``).

ZeRO-2 (``_torch/zero.py``: FSDP2 at stages 1-3, dim-0 shards of every parameter over the batch axis, as
ZeRO-3; the stages differ in when a unit is gathered): the dry run shards each expert tensor over the
whole axis; under EP the experts are held as at ZeRO-3 (EP the whole axis: FSDP2 leaves them out, whole
experts at ``1/EP``; EP smaller: each experts module its own FSDP2 unit over the ``batch / EP``
replicas), their gradients and AdamW state with the same shards. A stage-2 unit stays gathered from its
forward to its backward (one all-gather a step, not ``microbatches + 1``), and the dry run counts every
unit gathered at once (``step_measurement._unsharded_buffers``): the experts' share of that is replaced by EP's
(nothing when FSDP2 leaves them out, ``1/EP`` of them gathered over the replicas otherwise).
``ModelParallel`` (which EP needs) refuses ZeRO-1 alone, so the plan does too.

With a model axis (EP x TP): ``LayoutMap.auto(..., expert_axis=<batch axis>)`` gives the experts an EP
entry in place of any TP one, so each process holds ``num_experts / EP`` whole experts, replicated over the
model axis, whose processes route the same tokens; the dry run's model-axis layout (``LayoutMap.auto`` with
the model axis) has no TP entry for them either, so its expert bytes are the batch axis's alone, as above.
Each model-axis process dispatches its copy of the tokens within its EP group of the batch axis: the same
all-to-alls per process as without a model axis.

Found by the same structure ``LayoutMap.auto`` uses (``distribution.expert_layout.find_experts``).
The counts live in ``expert_holdings`` (bytes held) and ``expert_traffic`` (collectives); this module
checks a plan and applies them to a dry run's result.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from trainmesh.distribution.expert_layout import check_divisible, check_expert_parallel_size, find_experts

from .expert_holdings import _whole_expert_bytes, expert_bytes, stage_expert_paths
from .expert_traffic import (
    dispatch_traffic,
    expert_axes,
    expert_axis_strides,
    expert_gradient_traffic,
)
from .mesh_spec import MeshSpec

__all__ = [
    "apply_expert_parallel",
    "check_plan",
    "dispatch_traffic",
    "expert_axes",
    "expert_axis_strides",
    "expert_bytes",
    "expert_gradient_traffic",
    "stage_expert_paths",
]


def check_plan(meta_model: nn.Module, spec: MeshSpec, expert_parallel_size: int, zero_stage: int) -> None:
    """ValueError, before any dry run, for an EP plan this module cannot count: naming what is wrong."""
    axis = spec.batch_axis
    if zero_stage == 1:  # as training: _torch.parallelize refuses ModelParallel(zero_stage=1)
        raise ValueError(
            "expert_parallel_size trains under ModelParallel, which shards optimizer state with the parameters "
            "at zero_stage 2 or 3 and does not offer stage 1 alone; plan zero_stage 0, 2 or 3. "
            f"Received: zero_stage={zero_stage}"
        )
    ep = check_expert_parallel_size(expert_parallel_size, axis, spec.size(axis))
    found = find_experts(meta_model)[0]
    if not found:
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} needs a model with experts modules; "
            f"{type(meta_model).__name__} has none. Received: expert_parallel_size={expert_parallel_size}"
        )
    for experts in found:
        check_divisible(experts, axis, ep, spec.size(axis))


def apply_expert_parallel(
    result,
    meta_model: nn.Module,
    spec: MeshSpec,
    *,
    expert_parallel_size: int,
    zero_stage: int,
    precision: str,
    tokens: int | None = None,
    schedule: str = "1f1b",
):
    """``result`` (a dry run's ``RankResult``) with its expert parameters, gradients and optimizer state
    counted at EP's shares, and (``tokens``: a micro-batch's tokens on this process) the dispatch's
    all-to-alls added to its collectives; a note says how many expert bytes moved. With a pipe axis, only
    the experts of the result's rank's stages count (``stage_expert_paths``, with ``schedule``)."""
    only = stage_expert_paths(meta_model, spec, result.rank, microbatches=result.microbatches, schedule=schedule)
    counted = expert_bytes(
        meta_model,
        spec,
        expert_parallel_size=expert_parallel_size,
        zero_stage=zero_stage,
        precision=precision,
        only=only,
    )
    (dry, held), (dry_trained, held_trained) = counted["all"], counted["trainable"]
    ep_axis, _ = expert_axes(spec, expert_parallel_size)
    if tokens:
        calls, nbytes = dispatch_traffic(
            meta_model, tokens=tokens, expert_parallel_size=expert_parallel_size, precision=precision, only=only
        )
        if calls:
            result.collectives.add(ep_axis, "all_to_all", nbytes * result.microbatches, calls * result.microbatches)
            result.collectives.group_sizes[ep_axis] = expert_parallel_size
    expert_gradient_traffic(
        result.collectives,
        meta_model,
        spec,
        expert_parallel_size=expert_parallel_size,
        zero_stage=zero_stage,
        precision=precision,
        microbatches=result.microbatches,
        only=only,
    )
    buffers = result.buffers
    if zero_stage == 2:  # every unit gathered at once in the dry run, the experts whole among them
        gathered = 2 if precision in ("bf16-true", "bf16-mixed", "fp16-mixed") else None
        whole, _ = _whole_expert_bytes(meta_model, only, lambda p: gathered or p.element_size())
        _, replica_axis = expert_axes(spec, expert_parallel_size)
        buffers += (whole // expert_parallel_size if replica_axis else 0) - whole  # left out by FSDP2: none
    if dry == held and buffers == result.buffers:
        return result
    # the dry run's optimizer state bytes per gradient byte: 2 for Adam (exp_avg, exp_avg_sq), 1 for momentum
    states = round(result.optimizer / result.grads) if result.grads else 0
    trained = held_trained - dry_trained
    note = (
        f"experts: {expert_parallel_size}-way expert parallelism over {spec.batch_axis!r}: "
        f"{held:,} expert parameter bytes per process instead of {dry:,}"
        + (f" (the MoE layers of rank {result.rank}'s stages: {len(only)})" if only is not None else "")
    )
    return dataclasses.replace(
        result,
        params=result.params + held - dry,
        buffers=buffers,
        grads=result.grads + trained,
        optimizer=result.optimizer + states * trained,
        num_parameters_local=result.num_parameters_local + counted["numel"][1] - counted["numel"][0],
        notes=[*result.notes, note],
    )
