"""``search``: candidate meshes x ZeRO stages x checkpointing, each dry-run, ranked by step time.

Candidates: pipe x data x model meshes with a pipe axis of 1, 2, 4 or 8 (layers split in stages)
and a model axis of 1, 2, 4 or 8 (at most a node, where tensor parallelism's per-layer all-reduces
can stay on NVLink) that divide the world size; the rest is the batch axis. ZeRO stages 0-3 (1
only without a model or pipe axis: ModelParallel and pipelines offer 2-3), checkpointing none or
full. A mesh the model cannot be split on (no layer divides the model axis, fewer blocks than
stages) is skipped with a note.
Each candidate is a full dry run; the ones that fit ``device_memory`` are ranked fastest first
(estimated step time), ties to less communication.

When nothing fits and a sequence length is given, the search proposes a sequence axis
(``planner/sequence.py``): it plans the same candidates again with ``seq=2``, then 4, 8, ... taken
from the batch axis (a size must divide the batch axis and split the sequence into ``2 x seq``
chunks), stops at the smallest size under which something fits, and says why in ``proposal``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from .meta_model import build_meta_model
from .models import model_factory
from .parallel import ParallelPlan, plan_parallel
from .report import format_bytes


@dataclass
class SearchResult:
    plans: list[ParallelPlan]
    device_memory: int
    skipped: list[str] = field(default_factory=list)
    proposal: str | None = None  # why a sequence axis was added, when one was

    @property
    def ranked(self) -> list[ParallelPlan]:
        fitting = [p for p in self.plans if p.fits]
        return sorted(fitting, key=lambda p: (p.step.seconds, p.step.comm_share))

    @property
    def best(self) -> ParallelPlan | None:
        return self.ranked[0] if self.ranked else None

    def table(self) -> str:
        lines = [
            f"PLAN search (dry runs on a fake process group; not a measurement), device memory "
            f"{format_bytes(self.device_memory)}",
            "  #  mesh                       zero  checkpointing        peak  fits   step ms  comm    MFU",
        ]
        order = self.ranked + [p for p in self.plans if not p.fits]
        for i, p in enumerate(order, 1):
            mfu = f"{p.step.mfu:.1%}" if p.step.mfu is not None else "-"
            lines.append(
                f"{i:>3}  {p.mesh.text():<26} {p.zero_stage:>4}  {p.activation_checkpointing or 'none':<13}"
                f"{format_bytes(p.peak_bytes):>11}  {'yes' if p.fits else 'no':<4} {p.step.seconds * 1e3:>8.1f}"
                f"  {p.step.comm_share:>5.1%} {mfu:>6}"
            )
        if not self.ranked:
            lines.append(
                "nothing fits: "
                + (
                    min(self.plans, key=lambda p: p.peak_bytes).notes[-1]
                    if self.plans
                    else "no candidate could be planned"
                )
            )
        lines += [f"skipped: {s}" for s in self.skipped]
        if self.proposal:
            lines.append(self.proposal)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_memory": self.device_memory,
            "skipped": self.skipped,
            "proposal": self.proposal,
            "best": self.best.to_dict() if self.best else None,
            "ranked": [
                {
                    "mesh": p.mesh.text(),
                    "zero_stage": p.zero_stage,
                    "activation_checkpointing": p.activation_checkpointing,
                    "peak_bytes": p.peak_bytes,
                    "fits": p.fits,
                    "step_seconds": p.step.seconds,
                    "comm_share": p.step.comm_share,
                    "mfu": p.step.mfu,
                }
                for p in self.ranked + [p for p in self.plans if not p.fits]
            ],
        }


def candidates(
    world_size: int,
    max_model: int = 8,
    zero_stages=(0, 1, 2, 3),
    checkpointing_choices=(None, "full"),
    max_pipe: int = 8,
) -> list[tuple[str, int, str | None]]:
    """``(mesh, zero stage, checkpointing)`` for every pipe x data x model split of ``world_size`` with a
    pipe axis of 1, 2, 4 or 8 (at most ``max_pipe``) and a model axis of 1, 2, 4 or 8 (at most
    ``max_model``); ZeRO-1 only without a model or pipe axis (ModelParallel and pipelines shard with
    FSDP2 at stages 2-3).

    >>> sorted({mesh for mesh, _, _ in candidates(8, max_model=2, max_pipe=2)})
    ['data=4,model=2', 'data=8', 'pipe=2,data=2,model=2', 'pipe=2,data=4']
    """
    out = []
    for pipe in (1, 2, 4, 8):
        for model in (1, 2, 4, 8):
            if pipe > max_pipe or model > max_model or world_size % (pipe * model):
                continue
            mesh = (
                (f"pipe={pipe}," if pipe > 1 else "")
                + f"data={world_size // (pipe * model)}"
                + (f",model={model}" if model > 1 else "")
            )
            for zero in zero_stages:
                if zero == 1 and (model > 1 or pipe > 1):
                    continue
                for checkpointing in checkpointing_choices:
                    out.append((mesh, zero, checkpointing))
    return out


def search(
    model: str | nn.Module | Callable[[], nn.Module],
    *,
    world_size: int,
    device_memory: int,
    progress: Callable[[str], None] | None = None,
    zero_stages=(0, 1, 2, 3),
    checkpointing_choices=(None, "full"),
    max_model: int = 8,
    max_pipe: int = 8,
    **kwargs,
) -> SearchResult:
    """Dry-run and price every candidate (``candidates``); a pipe mesh gets ``microbatches`` (default
    2 x its pipe axis) and ``schedule`` from ``kwargs`` like ``plan_parallel``."""
    meta = build_meta_model(model if isinstance(model, nn.Module) else model_factory(model))
    result = SearchResult([], device_memory)
    meshes = candidates(world_size, max_model, zero_stages, checkpointing_choices, max_pipe)
    _plan_all(result, model, meta, meshes, world_size, device_memory, progress, kwargs)
    seq_len = kwargs.get("seq_len")
    if result.best is not None or not seq_len or not result.plans:
        return result
    smallest = min(p.peak_bytes for p in result.plans)
    size = 2
    while size <= world_size and result.best is None:
        with_seq = [(with_sequence_axis(m, size), z, c) for m, z, c in meshes]
        with_seq = [(m, z, c) for m, z, c in with_seq if m is not None]
        if with_seq and seq_len % (2 * size) == 0:
            _plan_all(result, model, meta, with_seq, world_size, device_memory, progress, kwargs)
            if result.best is not None:
                result.proposal = (
                    f"proposed: a sequence axis seq={size}, the smallest that fits: no mesh without one holds "
                    f"{seq_len} tokens a sequence (smallest peak {format_bytes(smallest)} over "
                    f"{format_bytes(device_memory)}); under seq={size} each process holds {seq_len // size} "
                    f"of them"
                )
        size *= 2
    return result


def with_sequence_axis(mesh: str, size: int) -> str | None:
    """``mesh`` with a ``seq`` axis of ``size`` taken from its batch axis, or None where it does not divide.

    >>> with_sequence_axis("pipe=2,data=4,model=2", 2), with_sequence_axis("data=2", 4)
    ('pipe=2,data=2,seq=2,model=2', None)
    """
    out = []
    for axis in mesh.split(","):
        name, n = axis.split("=")
        if name == "data":
            if int(n) % size:
                return None
            out += ([f"data={int(n) // size}"] if int(n) > size else []) + [f"seq={size}"]
        else:
            out.append(axis)
    return ",".join(out)


def _plan_all(result, model, meta, meshes, world_size, device_memory, progress, kwargs) -> None:
    for mesh, zero, checkpointing in meshes:
        try:
            plan = plan_parallel(
                meta,
                world_size=world_size,
                mesh=mesh,
                zero_stage=zero,
                activation_checkpointing=checkpointing,
                device_memory=device_memory,
                **kwargs,
            )
        except ValueError as exc:
            result.skipped.append(f"{mesh} zero {zero}: {exc}")
            continue
        plan.model = model if isinstance(model, str) else plan.model
        result.plans.append(plan)
        if progress:
            progress(
                f"  planned {mesh} zero {zero} checkpointing {checkpointing or 'none'}: peak "
                f"{format_bytes(plan.peak_bytes)}, step {plan.step.seconds * 1e3:.1f} ms"
            )
