"""``RankResult``: what one rank holds and does in one optimizer step, as a dry run or a real step measured it.

It exists on its own because the dry run (``dry_run.py``), the measurement (``step_measurement.py``),
the pricing (``step_time.py``) and the plan (``parallel_plan.py``) all read or write it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .collectives import CollectiveLog
from .op_costs import OpProfile


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


__all__ = ["RankResult"]
