"""``plan_parallel``: per-rank memory, collectives and step time of an N-rank mesh, from dry runs.

Everything per rank is *measured* on the dry run of the real code (``dry_run.run_rank``) for
the representative ranks of the mesh (``MeshSpec.representative_ranks``); this module only
adds up and prices what was measured:

* peak memory = params + optimizer + buffers + max(grads, activations), the Trainer's order
  (gradients freed after each step; with accumulation or a pipeline both are alive together);
* step time on ``hardware``: compute is every op the dry run dispatched, priced one by one
  (``op_costs.price``: matmuls by FLOPs at the rate a matmul of that size gets, memory-bound ops
  such as norms, activations and the optimizer's updates by the bytes they move, plus a per-op
  dispatch overhead and DTensor's sharding-propagation overhead), split into forward, backward
  and optimizer (plus ``fsdp hooks``: FSDP2's own work per gather or reduce-scatter call, where
  calibrated); each axis's collectives priced by the alpha-beta model with the backend's
  algorithms and each kind's own figures where measured (``hardware.axis_seconds``). Model- and pipe-axis traffic is on the critical path;
  batch-axis traffic (DDP buckets, FSDP2 gathers and reduce-scatters) overlaps forward and
  backward where the hardware can overlap (devices; a CPU host with a core to spare), and only
  its excess shows; a pipeline adds the (p-1)/m bubble. On a CPU host whose cores the processes
  share (with each other and with other load), the step is at least the work each process asks
  for times how much slower each of the node's processes runs when all run at once than one alone
  (``Hardware.contention``: measured by ``calibrate_cores`` where calibrated; the output names it;
  a pipeline's bubble and the work done beside another stage's bubble at the slowdown of the
  processes that run then). Traffic counts there at its CPU cost, its price on the link inside a
  node; what a slower link between nodes adds is waiting, added once, not stretched by the share;
* MFU = model FLOPs (6N + 12·L·H·T per token, the convention torchtitan and Megatron-LM report)
  per step over world size x step time x peak.

>>> from trainmesh.planner.parallel import plan_parallel
>>> p = plan_parallel("tiny-llama", world_size=8, mesh="data=4,model=2", zero_stage=3,
...                   micro_batch=1, seq_len=64)   # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from .dry_run import RankResult, run_rank
from .hardware import Hardware, axis_seconds, resolve_hardware
from .experts import apply_expert_parallel, check_plan as check_expert_plan, expert_axis_strides
from .mesh_spec import MeshSpec
from .sequence import sequence_axis_plan
from .op_costs import price
from .meta_model import build_meta_model
from .models import model_factory, model_shape
from .report import format_bytes, parse_bytes

CHECKPOINTING = (None, "none", "full", "selective")


@dataclass
class StepEstimate:
    compute: float
    axes: dict[str, float]  # seconds per axis
    exposed: dict[str, float]  # seconds per axis that compute does not hide
    seconds: float
    mfu: float | None
    phases: dict[str, float] = field(default_factory=dict)  # forward / backward / optimizer seconds

    @property
    def comm_share(self) -> float:
        """Exposed communication over step time (the pipeline bubble is idle time, not communication)."""
        comm = sum(t for a, t in self.exposed.items() if not a.endswith(" bubble") and a != "cores shared")
        return comm / self.seconds if self.seconds else 0.0

    @property
    def scaling_efficiency(self) -> float:
        """Compute over step time: 1.0 when no communication shows."""
        return self.compute / self.seconds if self.seconds else 0.0


@dataclass
class ParallelPlan:
    model: str
    mesh: MeshSpec
    zero_stage: int
    activation_checkpointing: str | None
    precision: str
    micro_batch: int
    seq_len: int | None
    num_parameters: int
    ranks: list[RankResult]
    step: StepEstimate
    hardware: Hardware
    device_memory: int | None
    grad_accum_steps: int = 1
    notes: list[str] = field(default_factory=list)
    num_trainable: int | None = None  # requires_grad parameters (fewer under LoRA: the base is frozen)
    parameter_bytes: int | None = None  # the whole model's parameters at their stored dtypes

    def peak(self, r: RankResult) -> int:
        together = self.grad_accum_steps > 1
        step = r.grads + r.activations if together else max(r.grads, r.activations)
        return r.params + r.optimizer + r.buffers + step

    @property
    def worst(self) -> RankResult:
        return max(self.ranks, key=self.peak)

    @property
    def peak_bytes(self) -> int:
        return self.peak(self.worst)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.peak_bytes <= self.device_memory

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "mesh": self.mesh.text(),
            "world_size": self.mesh.world_size,
            "zero_stage": self.zero_stage,
            "activation_checkpointing": self.activation_checkpointing,
            "precision": self.precision,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "num_parameters": self.num_parameters,
            "num_trainable": self.num_trainable,
            "parameter_bytes": self.parameter_bytes,
            "grad_accum_steps": self.grad_accum_steps,
            "ranks": [{**r.to_dict(), "peak": self.peak(r)} for r in self.ranks],
            "peak_bytes": self.peak_bytes,
            "device_memory": self.device_memory,
            "fits": self.fits,
            "step": {
                "compute_s": self.step.compute,
                "phases_s": self.step.phases,
                "axes_s": self.step.axes,
                "exposed_s": self.step.exposed,
                "seconds": self.step.seconds,
                "mfu": self.step.mfu,
                "comm_share": self.step.comm_share,
                "scaling_efficiency": self.step.scaling_efficiency,
            },
            "hardware": self.hardware.to_dict(),
            "notes": self.notes,
        }

    def table(self) -> str:
        lines = [
            "PLAN (dry run of trainmesh's parallelize on a fake process group; not a measurement)",
            f"model {self.model}: {_count(self.num_parameters)} parameters"
            + (
                f" ({_count(self.num_trainable)} trainable)"
                if self.num_trainable not in (None, self.num_parameters)
                else ""
            )
            + f", world size {self.mesh.world_size}, "
            f"mesh {self.mesh.text()}, ZeRO {self.zero_stage}, checkpointing "
            f"{self.activation_checkpointing or 'none'}, {self.precision}, micro-batch {self.micro_batch}"
            + (f" x {self.seq_len} tokens" if self.seq_len else ""),
            "",
            "per rank          params      grads  optimizer  activations    buffers       peak",
        ]
        for r in self.ranks:
            where = ",".join(f"{a}={i}" for a, i in r.coords.items())
            lines.append(f"rank {r.rank:<5} ({where})")
            lines.append(
                "                "
                + " ".join(
                    format_bytes(v).rjust(10)
                    for v in (r.params, r.grads, r.optimizer, r.activations, r.buffers, self.peak(r))
                )
            )
        worst_load = max(self.ranks, key=lambda r: r.load_peak)
        lines.append(
            f"loading (meta build + weights=, each rank reading its own shards): peak "
            f"{format_bytes(worst_load.load_peak)} on rank {worst_load.rank}, against "
            + (
                f"{format_bytes(self.parameter_bytes)} for the whole model at its stored dtypes"
                if self.parameter_bytes is not None
                else f"{format_bytes(self.num_parameters * 4)} for the whole model in fp32"
            )
        )
        if self.device_memory is not None:
            lines.append(
                f"device memory {format_bytes(self.device_memory)}: "
                + (
                    "fits"
                    if self.fits
                    else f"does NOT fit (over by {format_bytes(self.peak_bytes - self.device_memory)})"
                )
            )
        lines += [
            "",
            "collectives per step (rank " + str(self.worst.rank) + ")",
            "  axis      group  kind             calls        bytes",
        ]
        for row in self.worst.collectives.rows():
            lines.append(
                f"  {row['axis']:<9} {row['group_size']:>5}  {row['kind']:<15} {row['count']:>6} "
                f"{format_bytes(row['bytes']):>12}"
            )
        s = self.step
        lines += [
            "",
            f"step time on {self.hardware.name} ({self.hardware.source})",
            f"  compute {s.compute * 1e3:.1f} ms ("
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in s.phases.items())
            + "); "
            + "; ".join(f"{a} {t * 1e3:.1f} ms ({s.exposed.get(a, 0) * 1e3:.1f} exposed)" for a, t in s.axes.items())
            + "".join(
                f"; {a} {t * 1e3:.1f} ms" for a, t in s.exposed.items() if a.endswith(" bubble") or a == "cores shared"
            ),
            f"  step {s.seconds * 1e3:.1f} ms, communication share {s.comm_share:.1%}, scaling efficiency "
            f"{s.scaling_efficiency:.1%}" + (f", MFU {s.mfu:.1%}" if s.mfu is not None else ""),
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _phases(r: RankResult, hardware: Hardware, accum: int, batch_axis: str | None = None) -> dict[str, float]:
    """Seconds of forward, backward and optimizer on one rank, alone on its device: every op priced
    (``op_costs.price``) when the hardware has per-op figures, else the FLOPs at the peak rate."""
    if r.ops is not None and (hardware.memory_bandwidth or hardware.op_overhead or hardware.flops_curve):
        phases = price(r.ops, hardware)
    else:  # forward : backward FLOPs are about 1 : 2
        phases = {
            "forward": r.flops / 3 / hardware.flops,
            "backward": 2 * r.flops / 3 / hardware.flops,
            "optimizer": 0.0,
        }
    if hardware.fsdp_call_overhead:
        # FSDP2's hooks around each unit's gather and reduce-scatter (batch axis), on the rank's own thread
        calls = sum(
            row["count"]
            for row in r.collectives.rows()
            if row["axis"] == batch_axis and row["kind"] in ("all_gather", "reduce_scatter")
        )
        if calls:
            phases["fsdp hooks"] = calls * hardware.fsdp_call_overhead
    return {p: t * (accum if p != "optimizer" else 1) for p, t in phases.items()}


def estimate_step(
    ranks: list[RankResult],
    spec: MeshSpec,
    hardware: Hardware,
    *,
    tokens_per_rank: float | None,
    shape: dict,
    accum: int = 1,
) -> StepEstimate:
    """The slowest representative rank's step on ``hardware``; see the module docstring."""
    strides = {a: spec.stride(a) for a in spec.names}
    for r in ranks:  # EP's groups within the batch axis (experts.py)
        strides.update(expert_axis_strides(spec, r.collectives.group_sizes))
    overlap = hardware.overlaps(spec.world_size)
    worst = None
    for r in ranks:
        phases = _phases(r, hardware, accum, spec.batch_axis)
        compute = sum(phases.values())
        axes = {a: t * accum for a, t in axis_seconds(r.collectives, hardware, strides).items()}
        exposed = {}
        for axis, t in axes.items():
            # DDP's buckets and FSDP2's gathers/reduce-scatters run beside forward and backward; only
            # what does not fit behind them shows. Tensor-parallel and stage traffic is on the path.
            hidden = overlap and axis == spec.batch_axis
            exposed[axis] = max(0.0, t - phases["forward"] - phases["backward"]) if hidden else t
        path = compute + sum(exposed.values())
        if r.microbatches > 1 and spec.pipe_axis:
            # 1F1B / GPipe: p - 1 extra microbatch slots of the stage's critical path (the bubble)
            p = spec.size(spec.pipe_axis)
            critical = (
                phases["forward"]
                + phases["backward"]
                + phases.get("fsdp hooks", 0.0)
                + sum(t for a, t in exposed.items() if a != spec.batch_axis)
            )
            exposed[spec.pipe_axis + " bubble"] = critical * (p - 1) / r.microbatches
            path += exposed[spec.pipe_axis + " bubble"]
        seconds = path
        if hardware.cores:
            # Processes sharing a CPU host's cores (with each other and the host's other load): the step
            # is also at least the CPU time each process asks for (compute, and loopback copies) at the
            # share of a core it gets.
            slowdown = hardware.contention(spec.world_size)
            # the link figures were measured by 2 processes at once: their share is already in them
            comm_slowdown = slowdown / max(hardware.contention(2), 1e-9) if hardware.contention_curve else slowdown
            # Communication asks the cores for what it costs on the link inside a node (memory copies); what a
            # slower link between nodes adds on top is waiting, which the core share does not stretch.
            cpu_axes = {a: t * accum for a, t in axis_seconds(r.collectives, hardware, strides, all_intra=True).items()}
            link_wait = sum(max(0.0, exposed[a] - cpu_axes.get(a, 0.0)) for a in axes)
            busy = compute * slowdown + sum(cpu_axes.values()) * max(comm_slowdown, 1.0)
            bubble = exposed.get(f"{spec.pipe_axis} bubble", 0.0)
            if bubble:
                # A pipeline's stages do not all run at once: while this stage idles in the bubble the
                # others' processes run with one stage fewer sharing the cores, and the bubble's worth of
                # this stage's own work runs while another idles. Work done with all P processes running
                # costs the P-process slowdown, the rest (a bubble's worth, twice: this stage waiting,
                # then working) that of P (p-1)/p processes. With every process on its own core it is
                # compute + bubble, the path above; when the processes share the cores in full the
                # bubble hides behind the others' work.
                p = spec.size(spec.pipe_axis)
                fewer = hardware.contention(spec.world_size * (p - 1) // p)
                busy = (
                    max(compute - bubble, 0.0) * slowdown
                    + 2 * bubble * fewer
                    + sum(cpu_axes.values()) * max(comm_slowdown, 1.0)
                )
            busy += link_wait
            if hardware.shares_cores(spec.world_size) and busy > path:
                exposed["cores shared"] = busy - path
                seconds = busy
        if worst is None or seconds > worst.seconds:
            worst = StepEstimate(compute, axes, exposed, seconds, None, phases=phases)
    if tokens_per_rank and shape.get("num_layers") and shape.get("hidden") and worst.seconds:
        per_token = 6 * shape["num_parameters"] + 12 * shape["num_layers"] * shape["hidden"] * (shape.get("seq") or 0)
        worst.mfu = per_token * tokens_per_rank * accum / (worst.seconds * hardware.flops)
    return worst


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
