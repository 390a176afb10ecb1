"""Memory planner: per-rank bytes of a training run, per ZeRO stage and checkpointing choice,
from a meta-device model (nothing allocated).

>>> import torch
>>> from trainmesh.planner import plan
>>> print(plan(lambda: torch.nn.Linear(8, 8), world_size=2, micro_batch=2,
...            example_input=torch.zeros(2, 8)).rows[0].params)
288
"""

from .estimate import plan
from .report import PlanReport, PlanRow, format_bytes, parse_bytes

__all__ = ["plan", "PlanReport", "PlanRow", "format_bytes", "parse_bytes"]
