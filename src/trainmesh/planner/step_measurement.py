"""``measure_step``: parallelize a model as training does, run one step, and measure what the rank
holds (parameters, gradients, optimizer state, activations, working buffers), the collectives
per axis and every op.

It exists apart from ``dry_run.py`` because it runs the same way on a real process group with
real tensors (``benchmarks/plan_accuracy.py`` and the tests check plans with it); ``dry_run.run_rank``
only sets up the fake process group and fake tensors around it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .collectives import CollectiveCounter, CollectiveLog, group_axes
from .dry_run_pipeline import fsdp_stage, pipeline_traffic, run_fsdp_schedule, stage_backwards, stage_forwards
from .mesh_spec import MeshSpec
from .op_costs import OpProfile
from .rank_result import RankResult
from .recompute import RecomputeBytes, checkpointed_modules

_MIXED = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def _storage_bytes(tensors) -> int:
    """Bytes of distinct storages (a DTensor counts its local shard; FSDP2's padded shard included)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = getattr(t, "_local_tensor", t)
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _loss(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return first.float().mean()


def _unsharded_buffers(model: nn.Module, zero_stage: int, accumulating: bool = False) -> tuple[int, list[str]]:
    """Working copies during a step, read from the wrapped model itself.

    FSDP2: the unsharded size of each parameter group (all of them at stages 1-2, which keep units
    gathered from forward to backward; at stage 3 the root, every frozen group kept gathered to backward
    (``keep_frozen_gathered``) and the two largest others: the one computing and the one prefetched), each parameter in the dtype it is gathered in (a frozen
    16-bit base at its own), plus the largest group's unsharded gradient before its reduce-scatter
    (trainable parameters only). DDP: its gradient buckets. ``accumulating``: a pipeline stage under
    torch's schedule keeps every group gathered between microbatches and accumulates every group's
    unsharded gradient until the step's one reduce-scatter.
    """
    from trainmesh._torch.zero import fsdp_units

    notes: list[str] = []
    groups = []
    for _, module in fsdp_units(model):
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None:
            # this rank's unsharded piece: the padded shard times the shard group (a tensor-parallel
            # parameter's piece is its model-axis shard, not the global tensor)
            numels = [p._sharded_param_data.numel() * p.mesh_info.shard_mesh_size for p in group.fsdp_params]
            size = sum(n * (p.param_dtype or p.orig_dtype).itemsize for n, p in zip(numels, group.fsdp_params))
            # a frozen parameter (requires_grad=False: a LoRA base) is gathered but gets no gradient
            grad = sum(
                n * p.orig_dtype.itemsize for n, p in zip(numels, group.fsdp_params) if p.sharded_param.requires_grad
            )
            # a group not resharded after forward (the root; at stage 3 a kept frozen group, ``frozen_units.py``)
            # is held whole from its forward to its backward
            groups.append((module is model or group.post_forward_mesh_info is None, size, grad))
    if groups:
        if accumulating:
            return sum(size + grad for _, size, grad in groups), notes
        if zero_stage in (1, 2):  # FSDP2 at both (``_torch/zero.py``), units gathered forward to backward
            gathered = sum(size for _, size, _ in groups)
        else:
            root = sum(size for is_root, size, _ in groups if is_root)
            others = sorted((size for is_root, size, _ in groups if not is_root), reverse=True)
            gathered = root + sum(others[:2])
        kept = str(getattr(model, "_trainmesh_memory", {}).get("keep_frozen_gathered", ""))
        if zero_stage == 3 and kept.startswith(("on", "off (auto", "off (keep")):
            notes.append(f"frozen units kept gathered from forward to backward: {kept}")
        return gathered + max(g for _, _, g in groups), notes
    ddp = getattr(model, "_get_ddp_logging_data", None)
    if ddp is not None:
        sizes = [int(s) for s in str(ddp().get("bucket_sizes", "")).split(",") if s.strip()]
        return sum(sizes), notes
    return 0, notes


def _accumulated_grads(ops: OpProfile, params, microbatches: int) -> None:
    """The gradient accumulation a pipeline step does and one microbatch's backward does not show: after
    the first microbatch autograd adds each later one's gradient into ``.grad`` in place (an ``add_``
    reading two gradients and writing one), ``microbatches - 1`` times per parameter."""
    for p in params:
        if p.grad is not None and microbatches > 1:
            grad = getattr(p.grad, "_local_tensor", p.grad)
            key = ("backward", hasattr(p.grad, "_local_tensor"), 0, 3 * grad.numel() * grad.element_size(), "")
            ops.counts[key] += microbatches - 1


def _ddp_all_reduces(model: nn.Module, log: CollectiveLog, axis: str, size: int) -> None:
    data = model._get_ddp_logging_data()
    for s in str(data.get("bucket_sizes", "")).split(","):
        if s.strip():
            log.add(axis, "all_reduce", int(s))
    log.group_sizes[axis] = size


def measure_step(
    model: nn.Module,
    spec: MeshSpec,
    rank: int,
    args: tuple,
    kwargs: dict,
    *,
    zero_stage: int,
    activation_checkpointing: Any,
    precision: str,
    optimizer: Any = "adam",
    microbatches: int = 1,
    schedule: str = "1f1b",
    mode: Any = None,
    boundary: tuple | None = None,
    keep: dict | None = None,
) -> RankResult:
    """Parallelize ``model`` as training does and run one step, measuring it. With ``mode`` (a
    ``FakeTensorMode``) on the fake process group: the dry run; without, on a real group and real
    tensors: the same measurement of a real step (``benchmarks/plan_accuracy.py``)."""
    from trainmesh._torch.mesh import to_torch_mesh
    from trainmesh._torch.parallelize import parallelize

    from .model_states import resolve_optimizer

    fake = mode is not None
    mode = mode if fake else contextlib.nullcontext()
    distribution = spec.distribution(model, zero_stage=zero_stage, microbatches=microbatches, schedule=schedule)
    torch_mesh = to_torch_mesh(distribution.device_mesh)  # built outside the fake mode (real rank tensors)
    axis_of = group_axes(torch_mesh)
    regions = checkpointed_modules(model, activation_checkpointing)
    model = parallelize(
        model,
        distribution,
        zero_stage=zero_stage,
        activation_checkpointing=activation_checkpointing,
        mixed_precision=_MIXED.get(precision) if zero_stage >= 1 else None,
    )
    model.train()
    params = [p for p in model.parameters()]
    param_bytes = _storage_bytes(params) + _storage_bytes(model.buffers())
    num_local = sum(getattr(p, "_local_tensor", p).numel() for p in params)
    largest_tensor = max(
        (getattr(t, "_local_tensor", t).untyped_storage().nbytes() for t in [*params, *model.buffers()]), default=0
    )
    opt = resolve_optimizer(optimizer)([p for p in params if p.requires_grad])
    opt = distribution.prepare_optimizer(opt, model)
    counter = CollectiveCounter(axis_of)
    saved: dict[int, int] = {}
    hooks = []
    weights = {getattr(t, "_local_tensor", t).untyped_storage()._cdata for t in [*params, *model.buffers()]}

    def pack(t):
        local = getattr(t, "_local_tensor", t)
        storage = local.untyped_storage()
        key = storage._cdata
        if key not in weights and not isinstance(t, nn.Parameter):
            saved.setdefault(key, storage.nbytes())
        return t

    for module in model.modules():  # a module's parameters as it runs (FSDP2's gathered ones included)
        hooks.append(
            module.register_forward_pre_hook(
                lambda m, _: weights.update(
                    getattr(p, "_local_tensor", p).untyped_storage()._cdata for p in m.parameters(recurse=False)
                )
            )
        )
    is_ddp = hasattr(model, "_get_ddp_logging_data")
    sync = model.no_sync() if is_ddp and fake else contextlib.nullcontext()
    autocast = torch.autocast("cpu", dtype=_MIXED[precision]) if precision in _MIXED else contextlib.nullcontext()
    ops = OpProfile()
    recompute = RecomputeBytes(regions, saved)
    runner = getattr(model, "_trainmesh_pipeline", None)
    if runner is not None:  # the stages are copies: their own checkpointed modules
        recompute.close()
        regions = [m for stage in runner.stage_models for m in checkpointed_modules(stage, activation_checkpointing)]
        recompute = RecomputeBytes(regions, saved)
    with mode, counter, ops, sync, recompute:
        with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if runner is None:
                outputs = [model(*args, **kwargs)]
            else:
                outputs, inputs = stage_forwards(runner, args, kwargs, boundary)
        for output in outputs:
            for t in tree_leaves(output):  # alive until the loss is computed
                if isinstance(t, torch.Tensor):
                    saved.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
        activation_bytes = sum(saved.values())
        recompute.backward = True
        ops.phase = "backward"
        fsdp = fsdp_stage(runner) if runner is not None and microbatches > 1 else None
        if runner is None:
            _loss(outputs[0]).backward()
        elif fsdp is not None:  # every microbatch, in the schedule's order, as torch's stage drives FSDP
            run_fsdp_schedule(runner, fsdp, outputs, args, kwargs, boundary, microbatches, schedule, autocast, ops)
        else:
            stage_backwards(runner, outputs)
    recompute.close()
    for hook in hooks:
        hook.remove()
    notes: list[str] = []
    if runner is not None:
        boundary, per_step = pipeline_traffic(runner, outputs, inputs, distribution, spec, axis_of, mode)
        if fsdp is None:  # one microbatch was run: the others repeat it
            counter.log = counter.log.scaled(microbatches)
            ops = ops.scaled(microbatches)
            _accumulated_grads(ops, runner.parameters(), microbatches)
        counter.log = counter.log.merged(per_step)
        in_flight = microbatches if schedule == "gpipe" else min(microbatches, runner.pipe_size - runner.pipe_rank)
        activation_bytes *= in_flight
        measured = (
            (f"all {microbatches} microbatches run per stage in the schedule's order (FSDP as torch's stage drives it)")
            if fsdp is not None
            else (f"one microbatch measured per stage; compute and stage traffic x {microbatches}")
        )
        notes.append(
            f"pipeline ({schedule}, {microbatches} microbatches): {measured}; activations x the microbatches a "
            f"stage holds in flight "
            f"(1F1B: pipe size - stage; GPipe: all); send/recv counted from the measured boundary shapes"
        )
    activation_bytes += recompute.peak
    if is_ddp and fake:
        batch_axis = distribution.batch_dim_name
        _ddp_all_reduces(model, counter.log, batch_axis, distribution.device_mesh.axis_size(batch_axis))
    grad_bytes = _storage_bytes(p.grad for p in params)
    ops.phase = "optimizer"
    with mode, counter, ops:
        opt.step()
    optim_state = getattr(opt, "optim", opt).state  # ZeroRedundancyOptimizer keeps its shard's in .optim
    optimizer_bytes = _storage_bytes(v for s in optim_state.values() for v in s.values() if isinstance(v, torch.Tensor))
    if keep is not None:
        keep.update(model=model, optimizer=opt)
    buffers, buffer_notes = _unsharded_buffers(model, zero_stage, accumulating=runner is not None and fsdp is not None)
    notes += buffer_notes
    return RankResult(
        rank=rank,
        coords=spec.coords(rank),
        params=param_bytes,
        grads=grad_bytes,
        optimizer=optimizer_bytes,
        activations=activation_bytes,
        buffers=buffers,
        # the same formulas as ``flops.LocalFlops`` on the same local shards, counted by the op
        # profile already (a second dispatch mode over every op cost a tenth of the dry run)
        flops=ops.flops("forward") + ops.flops("backward"),
        collectives=counter.log,
        num_parameters_local=num_local,
        seconds=0.0,
        notes=notes,
        microbatches=microbatches if runner is not None else 1,
        in_flight=in_flight if runner is not None else 1,
        boundary=boundary if runner is not None else None,
        ops=ops,
        load_peak=param_bytes + largest_tensor,
    )
