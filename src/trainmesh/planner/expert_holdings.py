"""Expert bytes in a plan: which experts modules a rank's pipeline stages hold, and the bytes of their
parameters a process holds in the dry run against under expert parallelism (EP).

It exists apart from ``experts.py`` (which applies these counts to a dry run's result, and whose
docstring states the model of what EP holds) because both the memory counts and the traffic counts
(``expert_traffic.py``) are sums over the same experts, found here.
"""

from __future__ import annotations

import math

from torch import nn

from trainmesh.distribution.expert_layout import find_experts

from .mesh_spec import MeshSpec


def _rows(rows: int, shards: int) -> int:
    return math.ceil(rows / shards)


def stage_expert_paths(
    meta_model: nn.Module, spec: MeshSpec, rank: int, *, microbatches: int, schedule: str
) -> set[str] | None:
    """The paths of the experts modules in ``rank``'s pipeline stages, or None without a pipe axis (all of
    them). The split is the one the dry run's ``tm.Pipeline(axis, schedule, microbatches)`` makes (its
    defaults: blocks balanced by parameter count); experts outside the repeated blocks count on every stage."""
    from trainmesh._torch.pipeline import plan_split, stage_indices
    from trainmesh.distribution.pipeline import Pipeline

    pipe = spec.pipe_axis
    if not pipe or spec.size(pipe) <= 1:
        return None
    pipeline = Pipeline(axis=pipe, schedule=schedule, microbatches=microbatches)
    container, parts = plan_split(meta_model, pipeline, spec.size(pipe))
    mine = stage_indices(spec.coords(rank)[pipe], spec.size(pipe), pipeline.stages_per_rank, schedule)
    prefix = f"{container}." if container else ""
    held = tuple(f"{prefix}{block}." for i in mine for block in parts[i])
    blocks = tuple(f"{prefix}{block}." for part in parts for block in part)
    return {
        e.path
        for e in find_experts(meta_model)[0]
        if e.path.startswith(held) or not e.path.startswith(blocks)  # outside every block: on each stage
    }


def _experts_in(meta_model: nn.Module, only: set[str] | None):
    return [e for e in find_experts(meta_model)[0] if only is None or e.path in only]


def expert_bytes(
    meta_model: nn.Module,
    spec: MeshSpec,
    *,
    expert_parallel_size: int | None,
    zero_stage: int,
    precision: str,
    only: set[str] | None = None,
) -> dict[str, tuple[int, int]]:
    """``{"all": (dry, held), "trainable": (dry, held), "numel": (dry, held)}``: bytes of the expert parameters the dry run's rank
    holds and the bytes it holds under EP, for the rank with the largest shards (coordinate 0); the
    trainable ones alone have gradients and optimizer state; "numel" counts elements. EP None or 1: dry == held.
    ``only``: the experts modules counted (a pipeline stage's, ``stage_expert_paths``); None: all."""
    batch = spec.size(spec.batch_axis)
    ep = expert_parallel_size or 1
    zero = zero_stage >= 2  # FSDP2's dim-0 shards at stages 2 and 3 alike (stage 1 is refused under EP)
    totals = {"all": [0, 0], "trainable": [0, 0], "numel": [0, 0]}
    for experts in _experts_in(meta_model, only):
        module = meta_model.get_submodule(experts.path)
        for name in experts.param_names:
            param = getattr(module, name)
            element = 2 if precision == "bf16-true" else param.element_size()
            row = param[0].numel() * element  # one expert's bytes
            rows = param.shape[0]
            dry = _rows(rows, batch if zero else 1) * row
            held = _rows(rows // ep, batch // ep if zero else 1) * row
            for key in ("all", "trainable") if param.requires_grad else ("all",):
                totals[key][0] += dry
                totals[key][1] += held
            totals["numel"][0] += dry // element
            totals["numel"][1] += held // element
    return {key: (dry, held) for key, (dry, held) in totals.items()}


def _whole_expert_bytes(meta_model: nn.Module, only: set[str] | None, element) -> tuple[int, int]:
    """(all, trainable) bytes of the counted experts, unsharded, at ``element(param)`` bytes an element."""
    total = trainable = 0
    for experts in _experts_in(meta_model, only):
        module = meta_model.get_submodule(experts.path)
        for name in experts.param_names:
            param = getattr(module, name)
            nbytes = param.numel() * element(param)
            total += nbytes
            trainable += nbytes if param.requires_grad else 0
    return total, trainable
