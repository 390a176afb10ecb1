"""The planner's answer: one row per ZeRO stage x checkpointing choice, per-rank bytes, and a table.

>>> row = PlanRow(zero_stage=0, activation_checkpointing=None, params=2**30, grads=2**30, optimizer=2**31,
...               activations=2**29, buffers=0, budget=8 * 2**30)
>>> (format_bytes(row.total), row.fits)
('4.00 GiB', True)
>>> parse_bytes("8GiB") == 8 * 2**30
True
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def format_bytes(n: int | float) -> str:
    """Binary units, three significant figures: ``1536 -> '1.50 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str | int) -> int:
    """``"8GiB"``, ``"8 GB"`` (decimal), ``"512MiB"``, ``"1e9"`` or an int -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"Cannot read a byte size (try 8GiB, 512MB or 1e9). Received: {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class PlanRow:
    """Per-rank bytes of one configuration. ``buffers`` are working copies that exist only during a
    step (DDP's gradient buckets, FSDP's gathered parameters and unsharded unit gradients);
    ``host`` is what CPU offload moved off the device (not in ``total``). ``total`` is the peak of
    ``params + optimizer + buffers + max(grads, activations)``: the Trainer frees gradients after
    each step, so activations (forward end) and gradients (optimizer step) peak at different
    times; with gradient accumulation (``grads_with_activations``) they add up."""

    zero_stage: int
    activation_checkpointing: str | None
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    host: int = 0
    grads_with_activations: bool = False
    budget: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """The peak: gradients and activations add up only when both are alive at once (accumulation)."""
        step = self.grads + self.activations if self.grads_with_activations else max(self.grads, self.activations)
        return self.params + self.optimizer + self.buffers + step

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.total <= self.budget

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "notes": list(self.notes),
            "model_states": self.model_states,
            "total": self.total,
            "fits": self.fits,
        }


@dataclass
class PlanReport:
    """All rows plus what was planned; ``print(report)`` shows the table."""

    rows: list[PlanRow]
    world_size: int
    precision: str
    micro_batch: int
    num_parameters: int
    grad_accum_steps: int = 1
    budget: int | None = None
    notes: list[str] = field(default_factory=list)
    num_trainable: int | None = None  # requires_grad parameters (all of them unless some are frozen)

    def best(self, budget: int | str | None = None) -> PlanRow | None:
        """The cheapest-to-run row that fits ``budget`` (default: the planned budget), or None.

        Preference, fastest first: less sharding (each stage adds communication), then no
        recomputation; a row's total breaks ties. Without any budget, the smallest total.
        """
        limit = parse_bytes(budget) if budget is not None else self.budget
        if limit is None:
            return min(self.rows, key=lambda r: r.total, default=None)
        fitting = [r for r in self.rows if r.total <= limit]
        return min(fitting, key=lambda r: (r.zero_stage, r.activation_checkpointing is not None, r.total), default=None)

    def table(self) -> str:
        """A fixed-width table, one line per row."""
        show_host = any(r.host for r in self.rows)
        head = ["stage", "checkpointing", "params", "grads", "optimizer", "activations", "buffers", "total"]
        head += ["host"] * show_host + ["fits"] * (self.budget is not None)
        lines = [head]
        for r in self.rows:
            line = [str(r.zero_stage), r.activation_checkpointing or "none"]
            line += [format_bytes(v) for v in (r.params, r.grads, r.optimizer, r.activations, r.buffers, r.total)]
            line += [format_bytes(r.host)] * show_host + (
                ["yes" if r.fits else "no"] if self.budget is not None else []
            )
            lines.append(line)
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        text = [
            "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in lines
        ]
        trainable = (
            f" ({self.num_trainable:,} trainable)"
            if self.num_trainable is not None and self.num_trainable != self.num_parameters
            else ""
        )
        title = (
            f"per-rank memory: {self.num_parameters:,} parameters{trainable}, world size {self.world_size}, "
            f"{self.precision}, micro-batch {self.micro_batch}"
        )
        if self.budget is not None:
            title += f", budget {format_bytes(self.budget)}"
        return "\n".join([title, *text, *(f"note: {n}" for n in self.notes)])

    def to_json(self) -> str:
        return json.dumps(
            {
                "world_size": self.world_size,
                "precision": self.precision,
                "micro_batch": self.micro_batch,
                "grad_accum_steps": self.grad_accum_steps,
                "num_parameters": self.num_parameters,
                "num_trainable": self.num_trainable,
                "budget": self.budget,
                "notes": self.notes,
                "rows": [r.to_dict() for r in self.rows],
            },
            indent=2,
        )

    def __str__(self) -> str:
        return self.table()
