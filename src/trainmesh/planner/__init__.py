"""Planner: per-rank memory, collectives and step time of a run, from dry runs of trainmesh's own
``parallelize`` on torch's fake process group (nothing allocated, nothing sent).

``plan_parallel`` plans one mesh (data, model and pipe axes); ``search`` ranks candidates;
``plan`` is the data-parallel table (one row per ZeRO stage x checkpointing choice).

>>> import torch
>>> from trainmesh.planner import plan
>>> print(plan(lambda: torch.nn.Linear(8, 8), world_size=2, micro_batch=2,
...            example_input=torch.zeros(2, 8)).rows[0].params)
288
"""

from .estimate import plan
from .hardware import HARDWARE, Hardware, Link
from .mesh_spec import MeshSpec
from .parallel import ParallelPlan, plan_parallel
from .report import PlanReport, PlanRow, format_bytes, parse_bytes
from .search import SearchResult, search

__all__ = [
    "plan",
    "plan_parallel",
    "search",
    "ParallelPlan",
    "SearchResult",
    "MeshSpec",
    "Hardware",
    "Link",
    "HARDWARE",
    "PlanReport",
    "PlanRow",
    "format_bytes",
    "parse_bytes",
]
