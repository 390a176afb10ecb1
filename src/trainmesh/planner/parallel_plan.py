"""``ParallelPlan``: what ``plan_parallel`` returns, its peak-memory arithmetic and its printed table.

It exists apart from ``parallel.py`` so that the result (what a caller reads, prints or serialises)
reads on its own, away from how it is measured and priced.

Peak memory = params + optimizer + buffers + max(grads, activations), the Trainer's order
(gradients freed after each step; with accumulation or a pipeline both are alive together).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .rank_result import RankResult
from .hardware import Hardware
from .mesh_spec import MeshSpec
from .report import format_bytes
from .step_time import StepEstimate


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


__all__ = ["ParallelPlan"]
