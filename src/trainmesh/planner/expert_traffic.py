"""Expert traffic in a plan: the dispatch's all-to-alls at uniform routing, the names and strides of
EP's process groups, and the experts' gradient and parameter traffic moved out of the batch axis onto
the replicas' group (the counts are explained in ``experts.py``'s docstring).

It exists apart from ``experts.py`` because the step-time pricing (``step_time.py``) needs the
groups' strides without the memory counts.
"""

from __future__ import annotations

from torch import nn

from .collectives import CollectiveLog
from .expert_holdings import _experts_in, _whole_expert_bytes
from .mesh_spec import MeshSpec


def dispatch_traffic(
    meta_model: nn.Module, *, tokens: int, expert_parallel_size: int, precision: str, only: set[str] | None = None
) -> tuple[int, int]:
    """``(calls, full-buffer bytes)`` of one micro-batch's dispatch all-to-alls on one process, at uniform
    routing: per MoE layer 1 count exchange + 4 token exchanges of ``tokens x top_k x hidden`` elements.
    ``only``: the MoE layers counted (a pipeline stage's); None: all."""
    from trainmesh.distribution.expert_layout import _TOP_K_NAMES

    if expert_parallel_size <= 1:
        return 0, 0
    element = 2 if precision in ("bf16-true", "bf16-mixed", "fp16-mixed") else 4
    calls = nbytes = 0
    for experts in _experts_in(meta_model, only):
        module = meta_model.get_submodule(experts.path)
        router = meta_model.get_submodule(experts.router_path) if experts.router_path else None
        top_k = next((getattr(router, n) for n in _TOP_K_NAMES if isinstance(getattr(router, n, None), int)), 1)
        config_hidden = getattr(getattr(meta_model, "config", None), "hidden_size", None)
        # transformers' down_proj: (experts, hidden, intermediate)
        hidden = config_hidden or getattr(module, experts.param_names[-1]).shape[1]
        calls += 5
        nbytes += experts.num_experts * 8 + 4 * tokens * top_k * hidden * element
    return calls, nbytes


def expert_axes(spec: MeshSpec, expert_parallel_size: int) -> tuple[str, str | None]:
    """The names the rank's collectives file EP's traffic under: the EP group's (the batch axis when EP is
    the whole axis) and the group of processes holding the same experts (None when there is one)."""
    batch = spec.batch_axis
    if expert_parallel_size >= spec.size(batch):
        return batch, None
    return f"{batch}_expert", f"{batch}_expert_replica"


def expert_axis_strides(spec: MeshSpec, group_sizes: dict[str, int]) -> dict[str, int]:
    """Rank strides of ``expert_axes``'s groups, for pricing their links: EP takes neighbouring processes of
    the batch axis (``_torch.expert_parallel``), so its group has the axis's stride and the replicas' group
    that stride times EP."""
    batch = spec.batch_axis
    stride, size = spec.stride(batch), spec.size(batch)
    out = {}
    if f"{batch}_expert" in group_sizes:
        out[f"{batch}_expert"] = stride
    if f"{batch}_expert_replica" in group_sizes:
        out[f"{batch}_expert_replica"] = stride * (size // group_sizes[f"{batch}_expert_replica"])
    return out


def _take(log: CollectiveLog, axis: str, kind: str, nbytes: int) -> None:
    entry = log.traffic.get((axis, kind))
    if entry is not None:
        entry.bytes = max(0, entry.bytes - nbytes)


def expert_gradient_traffic(
    log: CollectiveLog,
    meta_model: nn.Module,
    spec: MeshSpec,
    *,
    expert_parallel_size: int,
    zero_stage: int,
    precision: str,
    microbatches: int,
    only: set[str] | None = None,
) -> None:
    """``log`` (a dry run's collectives) with the experts' gradient and parameter traffic as EP makes it
    (see the module docstring): out of the batch axis, onto the replicas' group where there is one."""
    batch = spec.batch_axis
    ep = expert_parallel_size
    if ep <= 1:
        return
    stored = 2 if precision == "bf16-true" else None  # the dry run casts every parameter then
    gathered = 2 if precision in ("bf16-true", "bf16-mixed", "fp16-mixed") else None  # FSDP2's compute dtype
    _, grad_bytes = _whole_expert_bytes(meta_model, only, lambda p: stored or p.element_size())
    _, replica_axis = expert_axes(spec, ep)
    modules = len(_experts_in(meta_model, only))
    if zero_stage == 0:
        _take(log, batch, "all_reduce", grad_bytes)
        if replica_axis and grad_bytes:  # one flattened all-reduce of the held experts' gradients
            log.add(replica_axis, "all_reduce", grad_bytes // ep, 1)
    elif zero_stage >= 2:
        gather_bytes, _ = _whole_expert_bytes(meta_model, only, lambda p: gathered or p.element_size())
        # ZeRO-3 gathers each microbatch's forward and once more for the backward; a stage-2 unit stays
        # gathered from its forward to its backward: once a step, with or without a pipe (the dry run's counts)
        gathers = microbatches + 1 if zero_stage == 3 else 1
        _take(log, batch, "all_gather", gathers * gather_bytes)
        _take(log, batch, "reduce_scatter", grad_bytes)
        if replica_axis:  # each experts module its own FSDP2 unit over the replicas
            log.add(replica_axis, "all_gather", gathers * gather_bytes // ep, gathers * modules)
            if grad_bytes:
                log.add(replica_axis, "reduce_scatter", grad_bytes // ep, modules)
    if replica_axis:
        log.group_sizes[replica_axis] = spec.size(batch) // ep
