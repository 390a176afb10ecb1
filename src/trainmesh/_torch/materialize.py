"""Meta-built models: storage for this process's shards only, filled from files or by the model's initialisers.

A model built under ``with torch.device("meta"):`` has shapes and no values. ``parallelize`` lays
it out while it is still on the meta device (tensor parallelism, FSDP2 and the pipeline split
all work on meta tensors, as torchtitan does), so ``to_empty`` then allocates only what this
process keeps: its FSDP2 shard, its tensor-parallel slice, its pipeline stage. Values come from:

* ``weights=``: safetensors files (``checkpoint/safetensors_reader.py``), each process reading
  only the byte ranges of its own shards; names are the model's ``state_dict`` keys, a tied
  weight may come under any of its names, and a bf16 file fills fp32 parameters (and back);
* otherwise the model's own initialisers, one *unit* at a time (a block of a ``ModuleList``,
  or a module with no block below it): the unit is rebuilt whole on the CPU from a meta copy
  taken before the layout, initialised as transformers does (``_init_weights`` of the
  innermost ``PreTrainedModel``, children before parents) or by ``reset_parameters``, then
  each process copies out its own slices. Each unit draws from a generator seeded by the
  seed and the unit's name, so every layout, world size and pipeline split gives the same
  values; they are not the values an eager CPU build gives (that draws one stream through
  the whole model in construction order), but come from the same initialisers.

Non-persistent buffers (rotary tables) are never in files: their units are initialised too.
A tensor no initialiser sets is refused by name (it would hold garbage from ``to_empty``).

A peft LoRA model over a Hugging Face checkpoint of its base: each tensor is looked up under its
own name and under the base checkpoint's (``adapters.base_checkpoint_name``: no
``base_model.model.`` prefix, no ``.base_layer``). The adapters are in no such file; they are
initialised as peft does (``nn.Linear``'s own initialisation, then the LoRA layer's
``reset_lora_parameters`` with the adapter's ``init_lora_weights``: ``lora_B`` zero), after
whatever transformers' ``_init_weights`` did to them as plain Linears.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from trainmesh.checkpoint.hf_expert_files import with_fused_experts
from trainmesh.checkpoint.safetensors_reader import WeightFileError, WeightFiles
from trainmesh.distribution.adapters import adapter_tensor_names, base_checkpoint_name, is_peft_model

from .init_units import Unit, checked_lora_inits, initialise_unit, plan_units
from .names import canonical_name
from .shard_ranges import local_region


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


@dataclass
class MaterializePlan:
    """What ``materialize`` needs, gathered while the model is still whole (before any collective)."""

    weights: WeightFiles | None
    seed: int
    meta: bool
    aliases: dict[str, list[str]] = field(default_factory=dict)  # name -> every name of the same tensor
    units: list[Unit] = field(default_factory=list)
    unit_of: dict[str, int] = field(default_factory=dict)  # first name of a tensor -> its unit
    initialiser_of: dict[str, nn.Module | None] = field(default_factory=dict)  # module path -> HF model
    peft: bool = False  # names may be the base checkpoint's
    lora_inits: dict[str, dict[str, object]] = field(default_factory=dict)  # LoRA layer -> adapter -> init

    def file_keys(self, name: str) -> list[str]:
        """The names ``name``'s tensor may have in a file: its aliases, and for a peft model the base's."""
        names = self.aliases.get(name, [name])
        return names + [base_checkpoint_name(n) for n in names] if self.peft else names

    def in_files(self, name: str) -> str | None:
        return next((n for n in self.file_keys(name) if n in self.weights), None) if self.weights is not None else None


def _alias_groups(model: nn.Module) -> dict[str, list[str]]:
    groups: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    return {name: names for names in groups.values() for name in names}


def _check_weights(model: nn.Module, plan: MaterializePlan) -> None:
    """Every key of the model's state_dict in the files with its shape, and nothing else there. A peft
    model's adapters may be missing (a base checkpoint): peft's initialisation gives them values."""
    files, aliases = plan.weights, plan.aliases
    state = model.state_dict(keep_vars=True)
    optional = adapter_tensor_names(model) if plan.peft else set()
    used, problems = set(), []
    for key, tensor in state.items():
        found = plan.in_files(key)
        if found is None:
            if key not in optional:
                problems.append(f"missing key {key!r} (shape {list(tensor.shape)})")
            continue
        used.add(found)
        entry = files.entries[found]
        if tuple(entry.shape) != tuple(tensor.shape):
            problems.append(
                f"key {found!r} has shape {list(entry.shape)} in {entry.file}; the model's is {list(tensor.shape)}"
            )
    problems += [
        f"unexpected key {k!r} in {files.entries[k].file}"
        for k in files.keys()
        if k not in used and not any(a in used for a in aliases.get(k, []))
    ]
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise WeightFileError(
            f"weights={files.source!r} do not fit {type(model).__name__}: " + "; ".join(problems[:8]) + more
        )


def open_weights(path):
    """A Hugging Face directory or ``.safetensors`` file, or a trainmesh sharded checkpoint directory."""
    from .checkpoint_weights import CheckpointWeights

    if CheckpointWeights.is_checkpoint(path):
        try:
            return CheckpointWeights(path)
        except ValueError as exc:
            raise WeightFileError(
                f"weights={str(path)!r} is neither a Hugging Face checkpoint directory "
                f"(no .safetensors files) nor a trainmesh checkpoint: {exc}"
            ) from None
    return WeightFiles.open(path)


def prepare(model: nn.Module, weights=None, seed: int = 0) -> MaterializePlan | None:
    """Check ``weights`` against ``model`` and note how to initialise it; ``None`` when there is
    nothing to do (a real model and no weights). Local: raises the same error on every process."""
    meta = has_meta_tensors(model)
    if not meta and weights is None:
        return None
    if meta and any(t.device.type != "meta" for t in [*model.parameters(), *model.buffers()]):
        real = next(n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta")
        raise ValueError(
            f"The model is partly on the meta device and partly not (first real tensor: {real!r}); "
            f"build it wholly under `with torch.device('meta'):` or wholly on the CPU."
        )
    files = weights if weights is None or hasattr(weights, "fill") else open_weights(weights)
    # a transformers MoE's fused experts, from the per-expert tensors its save_pretrained writes
    files = with_fused_experts(model, files)
    plan = MaterializePlan(
        weights=files, seed=int(seed), meta=meta, aliases=_alias_groups(model), peft=is_peft_model(model)
    )
    needed = None
    if files is not None:
        _check_weights(model, plan)
        # what no file holds (non-persistent buffers such as rotary tables, a base's new adapters)
        # comes from initialisers
        needed = {
            n
            for n, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
            if plan.in_files(n) is None
        }
    if meta:
        if plan.peft:
            plan.lora_inits = checked_lora_inits(model)
        plan_units(model, plan, needed)
    return plan


def _empty_like(tensor: torch.Tensor, device) -> torch.Tensor:
    """Uninitialised storage for this process's piece. ``torch.empty_like`` on a DTensor runs DTensor's
    sharding propagation for every new shape (most of a load's time on a CPU); allocating the local
    tensor and wrapping it is the same result."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local = torch.empty_like(tensor.to_local(), device=device)
        return DTensor.from_local(
            local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    return torch.empty_like(tensor, device=device)


def _targets(root: nn.Module) -> dict[str, torch.Tensor]:
    return {
        canonical_name(name): t
        for name, t in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
    }


def _retie(root: nn.Module, plan: MaterializePlan) -> None:
    """``to_empty`` gives each module its own new tensor; tied weights (a head sharing the embedding)
    must again be one parameter wherever this process holds both names."""
    modules = {canonical_name(n): m for n, m in root.named_modules()}
    params = dict(root.named_parameters(remove_duplicate=False))
    by_name = {canonical_name(n): p for n, p in params.items()}
    for name, names in plan.aliases.items():
        if name != names[0] or name not in by_name:
            continue
        for other in names[1:]:
            if other in by_name and by_name[other] is not by_name[name]:
                owner, _, attr = other.rpartition(".")
                setattr(modules[owner], attr, by_name[name])


def materialize(model: nn.Module, plan: MaterializePlan | None, device: torch.device | str) -> nn.Module:
    """Allocate this process's shards of a laid-out meta model and fill them (``plan`` from ``prepare``,
    taken before the layout). No collective: every process fills its own pieces."""
    from .sync import unwrap

    root = unwrap(model)
    if plan is None or getattr(root, "_trainmesh_materialized", False):
        return model
    root._trainmesh_materialized = True  # once: a later call must not reallocate what hooks now hold
    if plan.meta:
        root._apply(lambda t: _empty_like(t, device))  # to_empty's own step, cheaper for DTensors (below)
        _retie(root, plan)
    pending: dict[str, torch.Tensor] = {}
    filled: set[int] = set()
    from_files = []
    with torch.no_grad():
        for name, tensor in _targets(root).items():
            if id(tensor) in filled:
                continue
            key = plan.in_files(name)
            if key is not None:
                from_files.append((key, tensor, *local_region(tensor)))
                filled.add(id(tensor))
            elif plan.meta:
                pending[name] = tensor
        if from_files:
            plan.weights.fill(from_files)
        _fill_from_initialisers(pending, plan, filled)
    return model


def _fill_from_initialisers(pending: dict[str, torch.Tensor], plan: MaterializePlan, filled: set[int]) -> None:
    by_unit: dict[int, list[str]] = {}
    for name in pending:
        first = plan.aliases.get(name, [name])[0]
        if first not in plan.unit_of:
            raise ValueError(
                f"{name!r} of the laid-out model is not a tensor of the model it was built as; cannot initialise it"
            )
        by_unit.setdefault(plan.unit_of[first], []).append(name)
    for index in sorted(by_unit):
        values = initialise_unit(plan.units[index], plan)
        for name in by_unit[index]:
            tensor = pending[name]
            if id(tensor) in filled:
                continue
            source = next(n for n in plan.aliases.get(name, [name]) if n in values)
            local, offsets, shape = local_region(tensor)
            local.copy_(values[source][tuple(slice(o, o + s) for o, s in zip(offsets, shape))])
            filled.add(id(tensor))
        del values
