"""``plan_parallel``: per-rank memory, collectives and step time of an N-rank mesh, from dry runs.

Everything per rank is *measured* on the dry run of the real code (``dry_run.run_rank``) for
the representative ranks of the mesh (``MeshSpec.representative_ranks``); this module only
adds up and prices what was measured:

* peak memory = params + optimizer + buffers + max(grads, activations), the Trainer's order
  (gradients freed after each step; with accumulation or a pipeline both are alive together);
* step time on ``hardware`` (``step_time.estimate_step``): every op the dry run dispatched priced
  one by one, each axis's collectives by the alpha-beta model, overlap, the pipeline bubble and
  shared CPU cores; see ``step_time.py``;
* MFU = model FLOPs (6N + 12·L·H·T per token, the convention torchtitan and Megatron-LM report)
  per step over world size x step time x peak.

>>> from trainmesh.planner.parallel import plan_parallel
>>> p = plan_parallel("tiny-llama", world_size=8, mesh="data=4,model=2", zero_stage=3,
...                   micro_batch=1, seq_len=64)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from .dry_run import RankResult, run_rank
from .hardware import Hardware, resolve_hardware
from .experts import apply_expert_parallel, check_plan as check_expert_plan
from .mesh_spec import MeshSpec
from .sequence import sequence_axis_plan
from .meta_model import build_meta_model
from .models import model_factory, model_shape
from .parallel_plan import ParallelPlan
from .report import format_bytes, parse_bytes
from .step_time import StepEstimate, estimate_step

CHECKPOINTING = (None, "none", "full", "selective")


def plan_parallel(
    model: str | nn.Module | Callable[[], nn.Module],
    *,
    world_size: int,
    mesh: str | None = None,
    zero_stage: int = 0,
    activation_checkpointing: str | None = None,
    precision: str = "bf16-mixed",
    micro_batch: int = 1,
    seq_len: int | None = None,
    example_input: Any = None,
    optimizer: Any = "adam",
    device_memory: int | str | None = None,
    hardware: str | Hardware | None = "h100",
    grad_accum_steps: int = 1,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    expert_parallel_size: int | None = None,
    sequence_parallel: bool = False,
) -> ParallelPlan:
    """Dry-run ``model`` on an N-rank ``mesh`` and price it; see the module docstring. ``expert_parallel_size``:
    a mixture of experts' experts split over that many processes of the batch axis (``experts.py``)."""
    spec = MeshSpec.parse(mesh, world_size)  # bad meshes fail here, before anything is built
    sequence = sequence_axis_plan(mesh, world_size=world_size, seq_len=seq_len, sequence_parallel=sequence_parallel)
    spec = sequence.spec if sequence else spec  # a sequence axis dry-runs as data x seq at seq_len / seq
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3. Received: zero_stage={zero_stage!r}")
    if activation_checkpointing == "none":
        activation_checkpointing = None
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be an int >= 1. Received: micro_batch={micro_batch!r}")
    budget = parse_bytes(device_memory) if device_memory is not None else None
    hw = resolve_hardware(hardware)
    name = model if isinstance(model, str) else getattr(model, "__name__", type(model).__name__)
    meta = build_meta_model(model if isinstance(model, nn.Module) else model_factory(model))
    shape = {**model_shape(meta), "seq": seq_len}
    seq_len = sequence.local_seq_len if sequence else seq_len
    if expert_parallel_size:  # before any dry run: a bad EP size or a model without experts
        check_expert_plan(meta, spec, expert_parallel_size, zero_stage)
    pipe = spec.size(spec.pipe_axis)
    microbatches = microbatches or (2 * pipe if pipe > 1 else 1)
    ranks: list[RankResult] = []
    boundary = None
    for rank in spec.representative_ranks():  # pipe order: the first stage tells the others what they receive
        result = run_rank(
            meta,
            spec,
            rank,
            zero_stage=zero_stage,
            activation_checkpointing=activation_checkpointing,
            precision=precision,
            micro_batch=micro_batch,
            seq_len=seq_len,
            optimizer=optimizer,
            example_input=example_input,
            microbatches=microbatches,
            schedule=schedule,
            boundary=boundary,
        )
        boundary = boundary or result.boundary
        if expert_parallel_size:
            result = apply_expert_parallel(
                result,
                meta,
                spec,
                expert_parallel_size=expert_parallel_size,
                zero_stage=zero_stage,
                precision=precision,
                tokens=micro_batch * seq_len if seq_len else None,
                schedule=schedule,
            )
        ranks.append(result)
    dp = spec.size(spec.batch_axis)
    tokens = micro_batch * (seq_len or 0) * dp * (microbatches if pipe > 1 else 1) / world_size if seq_len else None
    step = estimate_step(ranks, spec, hw, tokens_per_rank=tokens, shape=shape, accum=grad_accum_steps)
    plan = ParallelPlan(
        model=str(name),
        mesh=spec,
        zero_stage=zero_stage,
        activation_checkpointing=activation_checkpointing,
        precision=precision,
        micro_batch=micro_batch,
        seq_len=seq_len,
        num_parameters=shape["num_parameters"],
        ranks=ranks,
        step=step,
        hardware=hw,
        device_memory=budget,
        grad_accum_steps=grad_accum_steps,
        num_trainable=sum(p.numel() for p in meta.parameters() if p.requires_grad),
        # bf16-true casts every parameter (the dry run does too); otherwise each keeps its own dtype
        parameter_bytes=sum(
            p.numel() * (2 if precision == "bf16-true" else p.element_size()) for p in meta.parameters()
        ),
    )
    plan.notes += sorted({n for r in ranks for n in r.notes})
    if sequence:  # sequence.py: the user's mesh and sequence back on the plan, the K/V traffic noted
        sequence.annotate(plan, meta, micro_batch, 4 if precision == "fp32" else 2)
    plan.notes.append(figures_used(hw, spec))
    plan.notes.append(
        "ranks dry-run: "
        + ", ".join(f"{r.rank} ({r.seconds:.1f} s)" for r in ranks)
        + "; other ranks hold the same or smaller shards"
    )
    if plan.fits is False:
        plan.notes.append(advice(plan))
    return plan


def figures_used(hw: Hardware, spec: MeshSpec) -> str:
    """Which of ``hw``'s figures priced the step, and where they come from (calibrated or published)."""
    kind = (
        "calibrated"
        if hw.source.startswith("calibrated")
        else "published"
        if hw.source.startswith("published")
        else "given"
    )
    parts = [
        f"best matmul {hw.flops / 1e9:,.1f} GFLOP/s"
        + (f" ({len(hw.flops_curve)}-point curve by size)" if hw.flops_curve else "")
    ]
    if hw.memory_bandwidth:
        parts.append(
            f"memory {hw.memory_bandwidth / 1e9:,.1f} GB/s"
            + (f" ({len(hw.bandwidth_curve)}-point curve)" if hw.bandwidth_curve else "")
        )
    if hw.op_overhead or hw.dtensor_op_overhead:
        parts.append(f"per op {hw.op_overhead * 1e6:.1f} us, per DTensor op +{hw.dtensor_op_overhead * 1e6:.1f} us")
    links = {hw.link_for(stride=spec.stride(a), size=spec.size(a)) for a in spec.names if spec.size(a) > 1}
    parts += [f"{link.name} alpha {link.alpha * 1e6:.1f} us, beta {link.beta / 1e9:.2f} GB/s" for link in links]
    if hw.cores:
        p = hw.processes_per_node(spec.world_size)
        how = "measured: that many processes running at once" if hw.contention_curve else "core count's fair share"
        where = "on this machine (its namespace hosts share them)" if hw.nodes_share_cores else "per node"
        parts.append(
            f"{p} processes {where} on {hw.cores} cores: each {hw.contention(spec.world_size):.2f}x slower "
            f"than one alone ({how})"
        )
    return f"figures used ({kind}): " + "; ".join(parts)


def advice(plan: ParallelPlan) -> str:
    """Which knob cuts the worst rank's peak the most, from its measured parts."""
    r = plan.worst
    over = plan.peak_bytes - plan.device_memory
    dp = plan.mesh.size(plan.mesh.batch_axis)
    options = []
    if plan.zero_stage < 3 and dp > 1:
        # what is still whole on each rank at this stage, and would be split dp ways at stage 3
        whole = {0: r.params + r.grads + r.optimizer, 1: r.params + r.grads, 2: r.params}[plan.zero_stage]
        options.append((whole * (1 - 1 / dp), f"--zero 3 (shards what is still whole over {dp} ranks)"))
    if plan.activation_checkpointing is None:
        options.append((r.activations * 0.7, "--activation-checkpointing full (keeps block inputs only)"))
    if plan.micro_batch > 1:
        options.append((r.activations * (1 - 1 / plan.micro_batch), "--micro-batch 1"))
    options.append(((r.params + r.grads + r.optimizer) / 2, "a model axis twice as large (model=2x)"))
    saved, knob = max(options)
    return (
        f"over the device memory by {format_bytes(over)} on rank {r.rank}; the knob that helps most: {knob}, "
        f"about {format_bytes(saved)} less"
    )


__all__ = ["plan_parallel", "ParallelPlan", "StepEstimate", "estimate_step", "figures_used"]
