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
``select_shard_units``. At stages 1-2 on CPU processes, consecutive default units (transformer
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

from .frozen_units import decide, frozen_groups
from .materialize import has_meta_tensors

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_warned_offload = [False]


def _param_bytes(module: nn.Module, skip: set[int]) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in skip)


def _first_module_list(model: nn.Module) -> nn.ModuleList | None:
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            return module
    return None


def _units_by_size(model: nn.Module, threshold: int) -> list[nn.Module]:
    """Bottom-up, as FSDP1's size policy: a module becomes a unit when the parameters it holds
    that no unit below it already holds exceed ``threshold`` bytes."""
    units: list[nn.Module] = []
    claimed: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is not model and _param_bytes(module, claimed) > threshold:
            units.append(module)
            claimed.update(id(p) for p in module.parameters())

    visit(model)
    return units


def select_shard_units(model: nn.Module, shard_unit) -> tuple[list[nn.Module], bool]:
    """The sub-modules to shard as their own FSDP unit (children before parents; the root is
    always a unit too and is not listed), and whether their order is the execution order.

    * ``None``: each child of the first non-empty ``nn.ModuleList`` (the transformer blocks of
      most models); without one, by size with a threshold of 1/8 of the model's bytes (so at
      most ~8 units of comparable size; a tiny model stays one unit).
    * a class or tuple of classes: every instance is a unit (e.g. each ``Block``).
    * an int: a byte threshold (see ``_units_by_size``).
    """
    if shard_unit is None:
        blocks = _first_module_list(model)
        if blocks is not None:
            return list(blocks), True
        return _units_by_size(model, max(_param_bytes(model, set()) // 8, 1)), False
    if isinstance(shard_unit, int):
        return _units_by_size(model, shard_unit), False
    units = [m for m in model.modules() if m is not model and isinstance(m, shard_unit)]
    # A unit nested in another is fine for FSDP2 only when the inner one is sharded first.
    units.sort(key=lambda m: -_depth(model, m))
    in_order = [m for m in model.modules() if any(m is u for u in units)]
    return units, _no_nesting(units) and len(in_order) == len(units)


# DDP's default gradient bucket (``bucket_cap_mb=25``): the bytes worth one blocking collective.
BLOCKING_BUCKET_BYTES = 25 * 2**20


def group_for_blocking_collectives(
    units: list[nn.Module], max_bytes: int = BLOCKING_BUCKET_BYTES
) -> list[nn.Module | list[nn.Module]]:
    """Consecutive units merged into groups of at most ``max_bytes`` parameter bytes (a unit larger
    than that stays alone); a group of one is the module itself, a larger one the list
    ``fully_shard`` takes as one unit.

    Why, at stages 1-2 on CPU processes: there are no streams there, so FSDP2 runs each unit's
    reduce-scatter inside backward and backward waits until every process has reached it; each unit
    is one point where all processes wait for the slowest. Stages 1-2 keep every unit gathered
    from its forward to its backward, so a larger unit costs no parameter memory, only its
    gradient before the reduce (as a larger DDP or DeepSpeed bucket does). Measured on the
    zero_memory benchmark's quick GPT (4 blocks of 3 MB, 4 processes on 2 cores, bf16): stage 1 at
    0.129-0.130 s/step as one group against 0.17-0.18 with a unit per block."""
    groups: list[list[nn.Module]] = []
    size = 0
    for unit in units:
        unit_bytes = _param_bytes(unit, set())
        if groups and size + unit_bytes <= max_bytes:
            groups[-1].append(unit)
            size += unit_bytes
        else:
            groups.append([unit])
            size = unit_bytes
    return [group[0] if len(group) == 1 else group for group in groups]


def _first_of(unit: nn.Module | list[nn.Module]) -> nn.Module:
    """The module that stands for a unit in FSDP2's prefetch lists (every module of a grouped unit
    shares its one parameter group)."""
    return unit[0] if isinstance(unit, list) else unit


def _depth(root: nn.Module, target: nn.Module) -> int:
    for name, module in root.named_modules():
        if module is target:
            return name.count(".") + 1
    return 0


def _no_nesting(units: list[nn.Module]) -> bool:
    ids = {id(u) for u in units}
    return all(not any(id(m) in ids for m in u.modules() if m is not u) for u in units)


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


def check_uniform_trainable_dtypes(units: list, model: nn.Module) -> None:
    """FSDP2 reduce-scatters a unit's gradients as one flat tensor: its trainable parameters must share
    a dtype (frozen ones may differ). Said here, naming the unit, not at the first backward."""
    claimed: set[int] = set()
    for unit in [*units, model]:  # children first: a parameter belongs to the innermost unit holding it
        modules = unit if isinstance(unit, list) else [unit]
        params = [p for m in modules for p in m.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        dtypes = sorted({str(p.dtype) for p in params if p.requires_grad})
        if len(dtypes) > 1:
            name = next((n for n, m in model.named_modules() if m is modules[0]), "") or "the root module"
            raise ValueError(
                f"ZeRO reduces each shard unit's gradients in one dtype; unit {name!r} holds "
                f"trainable parameters in {dtypes}. Cast them to one dtype, or freeze the odd ones. "
                f"Received: trainable dtypes {dtypes}"
            )


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
    if zero_stage == 3:
        excluded = _excluded_from_groups(model, experts if replica_mesh is None else set())
        candidates = frozen_groups([*units, model], excluded)  # the root's too: FSDP2 regathers it in backward
        keep, keep_state = decide(keep_frozen_gathered, candidates, options["mp_policy"].param_dtype)
        kept = candidates if keep else {}
    for unit in units:
        members = kept.get(id(unit))
        if members is not None and members != [unit]:  # a mixed unit: its frozen part first (children first)
            fully_shard(members, **{**options, "reshard_after_forward": False})
        reshard = options["reshard_after_forward"] and members != [unit]  # a wholly frozen unit: kept itself
        fully_shard(unit, **{**options, "reshard_after_forward": reshard})
    root_members = kept.get(id(model))
    if root_members is not None and root_members != [model]:
        fully_shard(root_members, **{**options, "reshard_after_forward": False})
    fully_shard(
        model, **{**options, "reshard_after_forward": options["reshard_after_forward"] and root_members != [model]}
    )
    if runtime.local_torch_device().type == "cpu":
        memory_trim.install(model)  # freed gather buffers back to the system between steps (RSS ~ live)
    if carries_reduce_scatter_by_all_reduce(group, runtime.local_torch_device()):
        install_all_reduce_scatter(model)  # gloo's own reduce-scatter: same bytes, 3x the time (see module)
    if ordered and units:
        # Gather unit i+1 while unit i computes (forward); at stage 3 also unit i-1 while unit i's
        # backward runs. Stages 1-2 gather each unit once per step, in forward, and keep it to its
        # backward, so the root starts the first one while its own layers run; nothing is freed before
        # backward there, so the peak is unchanged (measured at 4 processes, bf16: 0.170-0.175 s/step
        # against 0.180-0.181 without).
        if zero_stage < 3:
            model.set_modules_to_forward_prefetch([_first_of(units[0])])
        for current, following in zip(map(_first_of, units), map(_first_of, units[1:])):
            current.set_modules_to_forward_prefetch([following])
            if zero_stage == 3:
                following.set_modules_to_backward_prefetch([current])
        _prefetch_kept(model, units, kept)
    model._trainmesh_memory = {
        "zero_stage": zero_stage,
        "shard_units": len(units) + 1,
        "cpu_offload": offload_state,
        "keep_frozen_gathered": keep_state,
    }
    return model


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
