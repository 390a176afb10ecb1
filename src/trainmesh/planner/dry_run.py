"""A dry run of the real parallelization code for one rank of an N-rank world, on torch's fake
process group, with fake tensors: nothing is allocated, nothing is sent.

For a representative rank ``r``:

1. ``init_process_group("fake", FakeStore(), rank=r, world_size=N)``: every collective returns
   at once without moving data, but the process groups, their sizes and ranks are real;
2. the model (built on the meta device) is copied into fake tensors that claim the CPU
   (``meta_model.to_fake``), so kernels dispatch as on a real CPU run;
3. trainmesh's own ``parallelize`` (tensor layouts, activation checkpointing, DDP/FSDP2, the
   pipeline split) runs on it, unchanged: the parameters it leaves behind are the ones training
   would have, and their local shards' storages are what this rank holds;
4. the optimizer is built over those parameters (``Distribution.prepare_optimizer`` for ZeRO-1)
   and one forward, backward and optimizer step run under ``FakeTensorMode`` with three
   observers: ``CollectiveCounter`` (collectives per axis), ``op_costs.OpProfile`` (every op with
   its FLOPs, by ``flops.LocalFlops``'s formulas on the local shards, and bytes) and saved-tensor
   hooks (bytes autograd keeps for backward; with checkpointing, the checkpointed modules'
   inputs and the largest re-run in backward, ``recompute.RecomputeBytes``). A pipeline stage runs its
   ``StageModule`` on one microbatch (``dry_run_pipeline.py``).

``measure_step`` is steps 3-4 alone: on a real process group with real tensors it measures a
real step the same way, which is how the tests and ``benchmarks/plan_accuracy.py`` check plans.

Two things are bridged, each for a reason in torch, not in trainmesh (see ``_bridge_*``):

* ``nn.Module.to`` swaps FakeTensor parameters (``torch.utils.swap_tensors``), which torch
  refuses for fakes it tracks; the fakes are already on the target device, so the planner's
  copy of the model gets a ``to`` that returns it unchanged (this instance only);
* DDP's C++ reducer cannot finish an all-reduce on the fake backend (its hook future carries no
  tensor), so DDP's backward runs under ``no_sync`` and its all-reduces are read from DDP's
  own bucket assignment (``_get_ddp_logging_data()["bucket_sizes"]``).
"""

from __future__ import annotations

import contextlib
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .op_costs import OpProfile
from .collectives import CollectiveCounter, CollectiveLog, group_axes
from .dry_run_pipeline import fsdp_stage, pipeline_traffic, run_fsdp_schedule, stage_backwards, stage_forwards
from .mesh_spec import MeshSpec
from .recompute import RecomputeBytes, checkpointed_modules

_MIXED = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}

# torch warnings a dry run sets off that do not apply to it, kept out of the planner's output:
# * ``copy.deepcopy`` of a FakeTensor (the pipeline split copies the fake model into its stages)
#   reads the fake's data pointer inside torch's own ``Tensor.__deepcopy__``; the copy is right;
# * FSDP2 warns when the root module returns a view (a transformers model's logits under fake
#   tensors), because an in-place op on it would skip the all-gather; the dry run's loss
#   (``_loss``, or the model's own) is out of place.
_FALSE_ALARMS = (
    r"Accessing the data pointer of FakeTensor is deprecated",
    r"FSDP2-wrapped module \(.*\) returned a view tensor",
)


@dataclass
class RankResult:
    """What one rank holds and does in one optimizer step (one micro-batch forward/backward)."""

    rank: int
    coords: dict[str, int]
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    flops: int
    collectives: CollectiveLog
    num_parameters_local: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    microbatches: int = 1  # a pipeline step's microbatches (compute and per-microbatch traffic x this)
    in_flight: int = 1  # microbatches whose activations a pipeline stage holds at once
    boundary: tuple | None = None  # (shape, dtype) of the activation a pipeline stage sends on
    ops: OpProfile | None = None  # every op of the step with its FLOPs and bytes (op_costs.price prices it)
    # building on the meta device and loading weights= (see _torch/materialize.py): this rank's shards plus
    # one tensor in flight (FSDP2's padded copy of an uneven shard, or a read converting the file's dtype)
    load_peak: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "coords": self.coords,
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "flops": self.flops,
            "collectives": self.collectives.rows(),
            "num_parameters_local": self.num_parameters_local,
            "seconds": round(self.seconds, 3),
            "notes": self.notes,
            "microbatches": self.microbatches,
            "in_flight": self.in_flight,
            "ops": self.ops.rows() if self.ops is not None else None,
            "load_peak": self.load_peak,
        }


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


def _bridge_module_to(model: nn.Module) -> None:
    model.to = types.MethodType(lambda self, *args, **kwargs: self, model)


def _default_batch(model: nn.Module, micro_batch: int, seq_len: int | None, mode) -> tuple[tuple, dict]:
    """Token ids for a model that starts with an embedding (``labels=`` too for a transformers model)."""
    vocab = next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if vocab is None or seq_len is None:
        raise ValueError(
            "The dry run feeds token ids: the model needs an nn.Embedding and seq_len must be given. "
            f"Received: seq_len={seq_len!r}, embedding={'yes' if vocab else 'none'}"
        )
    with mode:
        ids = torch.zeros((micro_batch, seq_len), dtype=torch.long)
    if _is_hf(model):
        return (), {"input_ids": ids, "labels": ids}
    return (ids,), {}


def _is_hf(model: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


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


def run_rank(
    meta_model: nn.Module,
    spec: MeshSpec,
    rank: int,
    *,
    zero_stage: int,
    activation_checkpointing: Any,
    precision: str,
    micro_batch: int,
    seq_len: int | None,
    optimizer: Any = "adam",
    example_input: Any = None,
    microbatches: int = 1,
    schedule: str = "1f1b",
    boundary: tuple | None = None,
) -> RankResult:
    """Dry-run ``parallelize`` for ``rank`` of ``spec``; see the module docstring. ``boundary`` is the
    (shape, dtype) a pipeline stage receives (from the first stage's dry run)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainmesh import runtime

    from .activations import _to_fake_input
    from .meta_model import to_fake

    if dist.is_initialized():
        raise RuntimeError("run_rank needs a process without a process group (it starts a fake one)")
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        source = meta_model.to(torch.bfloat16) if precision == "bf16-true" else meta_model
        model = to_fake(source, mode, "cpu")
        _bridge_module_to(model)
        if example_input is not None:
            args = _to_fake_input(example_input, mode, "cpu", precision)
            args, kwargs = (args if isinstance(args, tuple) else (args,)), {}
        else:
            args, kwargs = _default_batch(model, micro_batch, seq_len, mode)
        with warnings.catch_warnings():
            for message in _FALSE_ALARMS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
            result = measure_step(
                model,
                spec,
                rank,
                args,
                kwargs,
                zero_stage=zero_stage,
                activation_checkpointing=activation_checkpointing,
                precision=precision,
                optimizer=optimizer,
                microbatches=microbatches,
                schedule=schedule,
                mode=mode,
                boundary=boundary,
            )
        result.seconds = time.perf_counter() - start
        return result
    finally:
        runtime.shutdown()  # forgets the torch meshes and the adopted group (not owned: not destroyed)
        if dist.is_initialized():
            dist.destroy_process_group()
        # DTensor caches sharding decisions keyed by mesh *shape*: the next rank's mesh compares equal
        # to this one but has new process groups, so a cached spec would name a destroyed group.
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


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
