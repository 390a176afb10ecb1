"""ZeRO stages 1, 2 and 3 -> FSDP2 ``fully_shard`` over the batch axis.

All three keep fp32 parameter shards between steps (the optimizer's master copy; its state is
created sharded with them), gather a unit's parameters (in the compute dtype; as stored for a model
that keeps some in 16 bits, see ``gather_dtype``) for its forward,
and reduce-scatter its gradients bucket by bucket (one bucket per unit) while backward runs, so
at the optimizer step a process holds only its shard of the gradients. What DeepSpeed's stage-1/2
optimizer does too: it reduces each bucket into the owner's partition during backward and frees
the full gradient. The stages differ in two places:

* accumulation (``sync.no_sync``, the micro-steps before the last): stage 1 skips the
  reduce-scatter and keeps each unit's *unsharded* gradient, adding micro-step after micro-step
  locally (no communication until the boundary, full-size gradients meanwhile); stages 2-3
  reduce-scatter every micro-step and add into the sharded gradient (ZeRO-2's promise: the
  gradients are partitioned at every moment after their bucket's backward).
* resharding: stages 1-2 use ``reshard_after_forward=False``: a unit's parameters stay
  gathered from its forward through its backward (no second all-gather); stage 3 uses
  ``reshard_after_forward=True``: gathered before use, freed after, again in backward. At every
  stage the next unit is prefetched (explicitly, in execution order, where we know it; FSDP2's
  implicit prefetch otherwise) so communication overlaps compute: in forward, and at stage 3
  in backward too.

Stage 1 thus shards a superset of what ZeRO-1 promises (optimizer state): parameters between
steps and gradients at the step as well. It moves the same bytes per step as DeepSpeed's stage 1
(one reduce-scatter of the gradients, one all-gather of the parameters: DeepSpeed gathers the
updated partitions after the step, FSDP2 before the next forward) and holds fewer; replicating
fp32 parameters and gradients instead (DDP + ``ZeroRedundancyOptimizer``, this module's stage 1
before) measured 1.74x DeepSpeed's stage-1 peak in ``benchmarks/zero_memory.py``.

On gloo (CPU processes) each unit's reduce-scatter is carried by an all-reduce of the same rows
(``comm/allreduce_scatter.py``): the same bytes on the wire as gloo's own reduce-scatter, a third
of its time.

The units (which sub-modules are gathered at once) come from ``shard_unit``: see
``select_shard_units`` (``shard_units.py``). At stages 1-2 on CPU processes, consecutive default units (transformer
blocks) are grouped up to ``BLOCKING_BUCKET_BYTES`` (see ``group_for_blocking_collectives``). We use torch's engine rather than our own sharding because FSDP2
already gives exact numerics (it reduce-scatters a SUM and divides by the group size, as
DDP averages), overlap and sharded state dicts.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from trainmesh import runtime
from trainmesh.runtime import memory_trim
from trainmesh.comm.allreduce_scatter import carries_reduce_scatter_by_all_reduce, install_all_reduce_scatter

from . import gather_buffer_release
from .frozen_units import decide, frozen_groups, keep_between_steps, released_after_forward, replicated_trainables
from .materialize import has_meta_tensors
from .replicated_grads import FlatGradAllReduce
from .shard_units import (
    first_of,
    check_uniform_trainable_dtypes,
    group_for_blocking_collectives,
    select_shard_units,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_warned_offload = [False]


def build_mixed_precision(
    compute_dtype: torch.dtype | None, reduce_dtype: str | None, model: nn.Module | None = None
) -> MixedPrecisionPolicy:
    """fp32 master shards (the parameters the optimizer sees); ``compute_dtype`` copies are
    gathered for forward/backward (for ``model``: see ``gather_dtype``); gradients are reduced in
    ``reduce_dtype`` (default fp32 under mixed precision: a bf16 reduce-scatter loses low bits of
    the averaged gradient)."""
    reduce = _DTYPES[reduce_dtype] if reduce_dtype else (torch.float32 if compute_dtype is not None else None)
    param_dtype = gather_dtype(model, compute_dtype) if model is not None else compute_dtype
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce)


def gather_dtype(model: nn.Module, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype FSDP2 gathers parameters in: ``compute_dtype`` for a model stored in fp32 (master
    weights; gathered cast, the all-gather moves half the bytes), ``None`` (as stored) for a model
    holding parameters stored in 16 bits (a frozen bf16 or fp16 base under fp32 LoRA adapters).

    Why as stored: FSDP2's cast applies to every use of a parameter, not only where autocast casts,
    and comes with a cast of each unit's inputs. An fp16 base under bf16-mixed then had its embedding
    and norm weights rounded to bf16 and its residual stream in bf16 (fp32 in one process), and its
    adapter gradients differed from one process by 20-50 bf16 ulps (1.5 under DDP). Gathered as stored,
    autocast casts the same matmuls as in one process; the fp32 adapters are a small share of the
    gathered bytes. The stored dtypes are the user's choice: the base is never cast in storage."""
    if compute_dtype is None:
        return None
    stored_16_bit = any(p.is_floating_point() and p.element_size() < 4 for p in model.parameters())
    return None if stored_16_bit else compute_dtype


def offload_policy(cpu_offload: bool) -> tuple[OffloadPolicy, str]:
    """FSDP2's ``CPUOffloadPolicy`` on CUDA (sharded parameters, gradients and optimizer state
    live in pinned host memory, the optimizer steps there). On a CPU run everything is in host
    memory already: accepted, reported once, a no-op."""
    if not cpu_offload:
        return OffloadPolicy(), "off"
    if runtime.torch_device_type() == "cuda":
        return CPUOffloadPolicy(), "on"
    if not _warned_offload[0]:
        warnings.warn(
            "cpu_offload=True on a CPU-only run is a no-op: model state is already in host memory.", stacklevel=3
        )
        _warned_offload[0] = True
    return OffloadPolicy(), "no-op (CPU run)"


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    *,
    zero_stage: int,
    shard_unit=None,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: str | None = None,
    cpu_offload: bool = False,
    keep_frozen_gathered: bool | str = "auto",
) -> nn.Module:
    """Shard ``model`` over ``dp_mesh`` as ZeRO ``zero_stage`` (1, 2 or 3).

    ``dp_mesh`` is the 1-D batch-axis mesh. A tensor-parallel model's parameters may already be
    DTensors on the model axis of the same mesh: FSDP2 then shards them over the batch axis too.
    ``keep_frozen_gathered`` (stage 3): each unit's frozen sub-modules as one unit gathered once per
    step (``frozen_units.py``).
    """
    assert zero_stage in (1, 2, 3), zero_stage
    if isinstance(model, FSDPModule):
        raise ValueError("The model is already sharded with fully_shard; pass the plain module.")
    units, ordered = select_shard_units(model, shard_unit)
    if zero_stage < 3 and shard_unit is None and ordered and runtime.local_torch_device().type == "cpu":
        units = group_for_blocking_collectives(units)
    check_uniform_trainable_dtypes(units, model)
    offload, offload_state = offload_policy(cpu_offload)
    options = dict(
        mesh=dp_mesh,
        reshard_after_forward=zero_stage == 3,
        offload_policy=offload,
        mp_policy=build_mixed_precision(compute_dtype, reduce_dtype, model),
    )
    experts = {p for p in model.parameters() if getattr(p, "_trainmesh_expert", False)}
    replica_mesh = getattr(model, "_trainmesh_expert_replica_mesh", None)
    if experts and replica_mesh is None:  # sharded over the whole batch axis by EP, gradients reduced by it
        options["ignored_params"] = experts
    group = dp_mesh.get_group()
    if not has_meta_tensors(model):  # a meta-built model is sharded first, filled after (materialize.py)
        model.to(runtime.local_torch_device())
        # fully_shard keeps each process's own chunk of its own copy; start every copy from the
        # first process's weights, as DDP does, so all stages start (and stay) identical. (DTensor
        # parameters were distributed from one source already.) Over the batch axis only: a pipeline
        # stage's processes on other axes hold other stages' tensors.
        first = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                if not hasattr(tensor, "placements"):
                    dist.broadcast(tensor.data, src=first, group=group)
    if replica_mesh is not None:  # EP < batch axis: each experts module sharded over the processes holding
        # the same experts (its own FSDP2 unit, torchtitan's "efsdp"), which also average its gradients
        for module in [m for m in model.modules() if hasattr(m, "_trainmesh_ep")]:
            fully_shard(module, **{**options, "mesh": replica_mesh})
    kept: dict[int, list[nn.Module]] = {}
    keep_state = "n/a (stages 1-2 keep every unit gathered)"
    replicated: list[str] = []
    released: list[nn.Module] = []
    if zero_stage == 3:
        excluded = _excluded_from_groups(model, experts if replica_mesh is None else set())
        # a frozen input embedding: its own unit, gathered for its forward only (``frozen_units.py``)
        released = released_after_forward(model, units, excluded)
        candidates = frozen_groups([*units, *released, model], excluded)  # the root's too: FSDP2 regathers it
        for module in released:  # in backward; the released ones are not kept (nothing reads them there)
            candidates.pop(id(module), None)
        keep, keep_state = decide(keep_frozen_gathered, candidates, options["mp_policy"].param_dtype)
        kept = candidates if keep else {}
        replicated = _replicated(model, kept, excluded, group)
        if replicated:  # left to FSDP2 as plain tensors (FlatGradAllReduce averages their gradients), so
            # every kept unit is wholly frozen as FSDP2 sees it: kept whole, one all-gather a step
            named = dict(model.named_parameters())
            options["ignored_params"] = set(options.get("ignored_params", ())) | {named[n] for n in replicated}
            kept = {id(u): [u] for u in [*units, model] if isinstance(u, nn.Module) and id(u) in kept}
    for unit in units:
        members = kept.get(id(unit))
        if members is not None and members != [unit]:  # a mixed unit: its frozen part first (children first)
            fully_shard(members, **{**options, "reshard_after_forward": False})
        reshard = options["reshard_after_forward"] and members != [unit]  # a wholly frozen unit: kept itself
        fully_shard(unit, **{**options, "reshard_after_forward": reshard})
    for module in released:  # resharded after forward (stage 3), and its backward reads nothing
        fully_shard(module, **options)
        module.set_unshard_in_backward(False)
    root_members = kept.get(id(model))
    if root_members is not None and root_members != [model]:
        fully_shard(root_members, **{**options, "reshard_after_forward": False})
    # The root stays gathered from its forward to its backward at every stage (FSDP2's and transformers'
    # default for a root): its forward encloses every other unit's, so its parameters (embedding, final
    # norm, head) are gathered through the whole forward anyway, and its backward begins as soon as
    # the forward ends; resharding it in between freed nothing at the peak and cost a second all-gather
    # of the model's largest unit, waited on before the first block's backward.
    fully_shard(model, **{**options, "reshard_after_forward": False})
    if runtime.local_torch_device().type == "cpu":
        memory_trim.install(model)  # freed gather buffers back to the system between steps (RSS ~ live)
        gather_buffer_release.install(model)  # no all-gather buffer held past its copy-out (no streams)
    if carries_reduce_scatter_by_all_reduce(group, runtime.local_torch_device()):
        install_all_reduce_scatter(model)  # gloo's own reduce-scatter: same bytes, 3x the time (see module)
    if ordered and units:
        # Gather unit i+1 while unit i computes (forward); at stage 3 also unit i-1 while unit i's
        # backward runs. Stages 1-2 gather each unit once per step, in forward, and keep it to its
        # backward, so the root starts the first one while its own layers run; nothing is freed before
        # backward there, so the peak is unchanged (measured at 4 processes, bf16: 0.170-0.175 s/step
        # against 0.180-0.181 without).
        if zero_stage < 3:
            model.set_modules_to_forward_prefetch([first_of(units[0])])
        for current, following in zip(map(first_of, units), map(first_of, units[1:])):
            current.set_modules_to_forward_prefetch([following])
            if zero_stage == 3:
                following.set_modules_to_backward_prefetch([current])
        _prefetch_kept(model, units, kept)
    if released:  # the root starts their gathers (and the first unit's) at once, not one after another
        own = [s._modules[0] for s in model._get_fsdp_state()._states_to_forward_prefetch]
        first = [first_of(units[0])] if ordered and units else []
        model.set_modules_to_forward_prefetch(list({id(m): m for m in [*released, *first, *own]}.values()))
    # frozen units gathered by the first forward stay gathered (``frozen_units.keep_between_steps``)
    between = keep_between_steps(fsdp_units(model)) if kept else []
    if replicated:
        model._trainmesh_replicated_grads = FlatGradAllReduce(model, replicated, group)
    model._trainmesh_memory = {
        "zero_stage": zero_stage,
        "shard_units": len(units) + len(released) + 1,
        "cpu_offload": offload_state,
        "keep_frozen_gathered": keep_state,
    }
    if zero_stage == 3:
        model._trainmesh_memory["replicated_trainables"] = _replicated_state(model, replicated)
        names = [n for n, m in model.named_modules() if any(m is r for r in released)]
        model._trainmesh_memory["released_after_forward"] = ", ".join(names) or "none"
        model._trainmesh_memory["kept_between_steps"] = ", ".join(between) or "none"
    return model


def _replicated(model: nn.Module, kept: dict, excluded: set[int], group) -> list[str]:
    """The trainable parameters to replicate (``frozen_units.replicated_trainables``),
    where that is the whole story: a plain model (no tensor-parallel or expert parameters) whose batch axis is
    the whole job. Under a pipeline, a model axis or a sequence axis the gradient norm and the checkpoints
    would count a plain parameter as held by every process, so those keep their adapters ZeRO-3."""
    params = list(model.parameters())
    if dist.get_world_size(group) != dist.get_world_size() or any(
        hasattr(p, "placements") or getattr(p, "_trainmesh_expert", False) for p in params
    ):
        return []
    return replicated_trainables(model, kept, excluded)


def _replicated_state(model: nn.Module, replicated: list[str]) -> str:
    if not replicated:
        return "none"
    nbytes = sum(model.get_parameter(n).numel() * model.get_parameter(n).element_size() for n in replicated)
    return (
        f"{len(replicated)} parameters ({nbytes / 2**20:.2f} MiB) replicated, gradients averaged by one flat "
        "all-reduce per backward"
    )


def _excluded_from_groups(model: nn.Module, ignored: set) -> set[int]:
    """Parameters a kept group must not hold: FSDP2-ignored ones and those shared between modules (a tied
    weight belongs to the unit FSDP2 gives it, not to a group of one of its users)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1} | {id(p) for p in ignored}


def _prefetch_kept(model: nn.Module, units: list, kept: dict[int, list[nn.Module]]) -> None:
    """Forward prefetch with kept frozen groups inside mixed units: unit i (its adapters, tiny) starts its
    own frozen group's all-gather, and that group, once it runs, the next one's, so each block's one big
    gather overlaps the block before it. (FSDP2 skips a prefetch of a group already gathered.)"""
    mixed = [(u, kept[id(u)][0]) for u in units if isinstance(u, nn.Module) and kept.get(id(u), [u]) != [u]]
    if not mixed:
        return
    if not model._get_fsdp_state()._states_to_forward_prefetch:
        model.set_modules_to_forward_prefetch([mixed[0][1]])
    for (unit, group), following in zip(mixed, [*[g for _, g in mixed[1:]], None]):
        own = unit._get_fsdp_state()._states_to_forward_prefetch
        unit.set_modules_to_forward_prefetch([group, *[s._modules[0] for s in own]])
        if following is not None:
            group.set_modules_to_forward_prefetch([following])


def fsdp_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """One ``(name, module)`` per FSDP2 unit of ``model``, in module order: a unit of several modules
    (stages 1-2 on CPU group consecutive blocks, ``group_for_blocking_collectives``) shares one state,
    and is named by its first module. A module of an FSDP class without a state (a pipeline stage's
    copy of a sharded root) is no unit of this model."""
    from torch.distributed.fsdp._fully_shard._fully_shard import _get_module_fsdp_state

    units, seen = [], set()
    for name, module in model.named_modules():
        state = _get_module_fsdp_state(module) if isinstance(module, FSDPModule) else None
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            units.append((name, module))
    return units


def is_fsdp_model(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)
