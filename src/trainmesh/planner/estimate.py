"""``plan``: per-rank memory of training a model, for each ZeRO stage and checkpointing choice.

The data-parallel special case of ``plan_parallel``: a mesh ``data=N``, one dry run of trainmesh's
own ``parallelize`` per ZeRO stage on torch's fake process group (``dry_run.run_rank``, rank 0, which
holds the largest shards). Parameters, gradients and optimizer state are the storages the real
DDP / ZeroRedundancyOptimizer / FSDP2 objects leave on that rank; ``buffers`` are the working copies
read from the same objects (DDP's gradient buckets; FSDP2's unsharded parameter groups: all of them
at stage 2, the root and two blocks (the one computing and the one prefetched) at stage 3, plus the
largest group's unsharded gradient before its reduce-scatter). Nothing here re-derives sharding.

Frozen parameters (``requires_grad=False``: the base of a LoRA fine-tune) count as the dry run holds
them: at their own dtype (a bf16 base at 2 bytes beside fp32 adapters), sharded at stage 3 like the
rest, with no gradient, no optimizer state (the optimizer is built over the trainable ones, as the
Trainer builds it) and no unsharded gradient in ``buffers``.

``activations`` is measured by a fake forward of the unwrapped model (``activations.py``), for
each checkpointing policy; with checkpointing it includes one block's recompute. ``total`` is
``params + optimizer + buffers + max(grads, activations)`` (both with accumulation). Not counted:
the batch, the loss's own saved tensors, allocator/runtime overhead.

>>> import torch
>>> report = plan(lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)),
...               world_size=2, micro_batch=4, example_input=torch.zeros(4, 64), budget_bytes="1MiB")
>>> [(r.zero_stage, r.activation_checkpointing) for r in report.rows][:3]
[(0, None), (0, 'full'), (1, None)]
>>> report.best().zero_stage
0
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .activations import ActivationProfile, checkpoint_paths, measure_activations
from .dry_run import RankResult, run_rank
from .mesh_spec import MeshSpec
from .meta_model import build_meta_model
from .report import PlanReport, PlanRow, parse_bytes

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")


def _default_input(meta_model: nn.Module, micro_batch: int, seq_len: int | None) -> torch.Tensor:
    first = next((m for m in meta_model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if not isinstance(first, nn.Embedding):
        raise ValueError(
            "example_input is required unless the model's first layer is an nn.Embedding "
            f"(then (micro_batch, seq_len) token ids are used). Received: first layer "
            f"{type(first).__name__}, example_input=None"
        )
    if seq_len is None:
        raise ValueError("seq_len is required for a model that starts with an nn.Embedding. Received: seq_len=None")
    return torch.zeros((micro_batch, seq_len), dtype=torch.long, device="meta")


def _has_full(meta_model: nn.Module) -> bool:
    """Whether "full" checkpointing applies (the default second row): the model has repeated blocks."""
    try:
        return bool(checkpoint_paths(meta_model, "full"))
    except ValueError:
        return False


def _stage_row(
    rank: RankResult,
    stage: int,
    *,
    cpu_offload: bool,
    policy: str | None,
    activations: int,
    budget: int | None,
    accumulate: bool,
) -> PlanRow:
    params, grads, optimizer, buffers = rank.params, rank.grads, rank.optimizer, rank.buffers
    notes: list[str] = []
    host = 0
    if cpu_offload and stage >= 2:
        # FSDP2's CPUOffloadPolicy keeps the sharded states in host memory; buffers stay on the device.
        host, params, grads, optimizer = params + grads + optimizer, 0, 0, 0
        notes.append("sharded states offloaded to host memory (a no-op on a CPU-only run)")
    elif cpu_offload:
        notes.append("cpu_offload needs stage 2 or 3; not applied")
    notes += [n for n in rank.notes if n.startswith("frozen units kept gathered")]  # said on or off, and why
    return PlanRow(
        zero_stage=stage,
        activation_checkpointing=policy,
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        buffers=buffers,
        host=host,
        budget=budget,
        grads_with_activations=accumulate,
        notes=tuple(notes),
    )


def plan(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    *,
    world_size: int,
    zero_stage: int | None = None,
    precision: str = "fp32",
    micro_batch: int,
    seq_len: int | None = None,
    example_input: Any = None,
    activation_checkpointing: str | None = None,
    cpu_offload: bool = False,
    budget_bytes: int | str | None = None,
    optimizer: Any = "adam",
    grad_accum_steps: int = 1,
    device: str = "cpu",
) -> PlanReport:
    """Plan per-rank memory without allocating the model (it is built on the meta device).

    ``example_input`` is one micro-batch (leading dimension ``micro_batch``; a tuple is passed as
    positional arguments); for a model that starts with an ``nn.Embedding`` it may be left out and
    ``(micro_batch, seq_len)`` token ids are used. ``optimizer``: ``"adam"``, ``"adamw"``, ``"sgd"``
    (momentum 0.9), an optimizer class, or ``params -> optimizer``. ``device`` is where the real
    run computes (kernel choice changes what is saved for backward). ``grad_accum_steps > 1``
    keeps gradients alive across micro-steps, so they add to the activations.

    >>> import torch
    >>> r = plan(lambda: torch.nn.Linear(1000, 1000), world_size=4, zero_stage=3, micro_batch=8,
    ...          example_input=torch.zeros(8, 1000), activation_checkpointing=None)
    >>> r.rows[0].params   # (1000*1000 + 1000) * 4 bytes, split in 4 along dim 0
    1001000
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1. Received: world_size={world_size!r}")
    if zero_stage not in (None, 0, 1, 2, 3):
        raise ValueError(f"zero_stage must be None or 0..3. Received: zero_stage={zero_stage!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}. Received: precision={precision!r}")
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be an int >= 1. Received: micro_batch={micro_batch!r}")
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be an int >= 1. Received: grad_accum_steps={grad_accum_steps!r}")
    budget = parse_bytes(budget_bytes) if budget_bytes is not None else None
    meta_model = build_meta_model(model_or_factory)
    if precision == "bf16-true":
        meta_model.to(torch.bfloat16)
    if example_input is None:
        example_input = _default_input(meta_model, micro_batch, seq_len)
    elif isinstance(example_input, torch.Tensor) and example_input.dim() and example_input.shape[0] != micro_batch:
        raise ValueError(
            f"example_input must be one micro-batch (leading dim {micro_batch}). "
            f"Received: shape {tuple(example_input.shape)}"
        )
    policies = (
        [None, activation_checkpointing] if activation_checkpointing else [None] + ["full"] * _has_full(meta_model)
    )
    activations: dict[str | None, int] = {}
    for policy in policies:
        paths = checkpoint_paths(meta_model, policy)
        profile: ActivationProfile = measure_activations(
            meta_model, example_input, precision, checkpoint_paths=paths, device=device
        )
        kept, transient = profile.with_checkpointing(paths) if policy else (profile.total_bytes, 0)
        activations[policy] = kept + transient
    stages = [zero_stage] if zero_stage is not None else [0, 1, 2, 3]
    spec = MeshSpec.parse(None, world_size)
    measured = {
        stage: run_rank(
            meta_model,
            spec,
            0,
            zero_stage=stage,
            activation_checkpointing=None,
            precision=precision,
            micro_batch=micro_batch,
            seq_len=seq_len,
            optimizer=optimizer,
            example_input=example_input,
        )
        for stage in stages
    }
    rows = [
        _stage_row(
            measured[stage],
            stage,
            cpu_offload=cpu_offload,
            policy=policy,
            activations=activations[policy],
            budget=budget,
            accumulate=grad_accum_steps > 1,
        )
        for stage in stages
        for policy in policies
    ]
    num_parameters = sum(p.numel() for p in meta_model.parameters())
    num_trainable = sum(p.numel() for p in meta_model.parameters() if p.requires_grad)
    notes = [
        "total = params + optimizer + buffers + "
        + (
            "grads + activations (accumulation keeps gradients alive)"
            if grad_accum_steps > 1
            else "max(grads, activations) (gradients are freed after each step)"
        )
    ]
    if num_trainable < num_parameters:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in meta_model.parameters() if not p.requires_grad})
        notes.append(
            f"{num_parameters - num_trainable:,} frozen parameters ({', '.join(dtypes)}) are counted at "
            "their own dtype, with no gradient and no optimizer state"
        )
    if activation_checkpointing == "selective":
        notes.append(
            "selective checkpointing is planned as full checkpointing of the same blocks: the "
            "saved matmul outputs it keeps are not counted (activations are under-stated)"
        )
    return PlanReport(
        rows=rows,
        world_size=world_size,
        precision=precision,
        micro_batch=micro_batch,
        grad_accum_steps=grad_accum_steps,
        num_parameters=num_parameters,
        budget=budget,
        notes=notes,
        num_trainable=num_trainable,
    )
