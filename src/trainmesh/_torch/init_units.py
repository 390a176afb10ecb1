"""Initialisation units of a meta-built model: which modules are initialised together, and how.

A *unit* is a block of a ``ModuleList`` (``ModuleDict``, ``Sequential``), or a module with no
block below it, or a container's own tensors without its children. ``plan_units`` takes a meta
copy of each, before the layout changes the model; ``initialise_unit`` rebuilds one whole on the
CPU and runs its initialisers in transformers' order (children before parents): the innermost
``PreTrainedModel``'s ``_init_weights``, else ``reset_parameters``; a peft LoRA layer last, as
peft does. Each unit draws from a generator seeded by the seed and the unit's name, so every
layout, world size and pipeline split gives the same values. Memory: one unit at a time.
``materialize.py`` decides which units a process needs and copies out its slices.
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainmesh.distribution.adapters import is_lora_layer, lora_inits

from .names import canonical_name

if TYPE_CHECKING:
    from .materialize import MaterializePlan


@dataclass
class Unit:
    path: str  # module path in the whole model ("" for the root)
    shadow: nn.Module  # a meta copy taken before the layout (whole subtree, or shallow)
    names: list[str]  # full names of the tensors it initialises


def _is_hf_model(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config")


def _block_roots(model: nn.Module) -> set[str]:
    """Elements of module containers (transformer blocks): each is an initialisation unit."""
    roots = set()
    lora_layers = {name for name, module in model.named_modules() if is_lora_layer(module)}
    for name, module in model.named_modules():
        if name.rpartition(".")[0] in lora_layers:
            continue  # a LoRA layer's adapter dicts: the layer is initialised whole (peft's order)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and module is not model:
            roots.update(f"{name}.{child}" if name else child for child, _ in module.named_children())
    return roots


def plan_units(model: nn.Module, plan: MaterializePlan, needed: set[str] | None) -> None:
    """The initialisation units (meta copies of them) holding a tensor of ``needed`` (None: all)."""
    roots = _block_roots(model)

    def wanted(names: list[str]) -> bool:
        return needed is None or any(n in needed for n in names)

    def is_unit(path: str) -> bool:
        return path in roots or not any(r.startswith(f"{path}.") or not path for r in roots)

    def visit(path: str, module: nn.Module) -> None:
        prefix = f"{path}." if path else ""
        if is_unit(path):
            names = [
                prefix + n
                for n, _ in [
                    *module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False),
                ]
            ]
            if names and wanted(names):
                _add_unit(plan, path, copy.deepcopy(module), names)
            return
        direct = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if direct and wanted([prefix + n for n, _ in direct]):  # a container's own tensors, without its children
            shadow = copy.copy(module)
            shadow._modules = {}
            shadow._parameters = copy.deepcopy(module._parameters)
            shadow._buffers = copy.deepcopy(module._buffers)
            _add_unit(plan, path, shadow, [prefix + n for n, _ in direct])
        for child_name, child in module.named_children():
            visit(prefix + child_name, child)

    visit("", model)
    for path, module in model.named_modules():  # pre-order: a parent's entry exists before its children's
        parent = plan.initialiser_of.get(path.rsplit(".", 1)[0] if "." in path else "") if path else None
        plan.initialiser_of[path] = module if _is_hf_model(module) else parent


def _add_unit(plan: MaterializePlan, path: str, shadow: nn.Module, names: list[str]) -> None:
    plan.units.append(Unit(path, shadow, names))
    for name in names:
        first = plan.aliases.get(name, [name])[0]
        plan.unit_of.setdefault(first, len(plan.units) - 1)


def checked_lora_inits(model: nn.Module) -> dict[str, dict[str, object]]:
    """peft's ``init_lora_weights`` per layer; the kinds computed from the base's values (PiSSA,
    OLoRA, LoftQ, EVA, ...) need real weights at ``get_peft_model`` time and are refused here."""
    inits = lora_inits(model)
    for path, by_adapter in inits.items():
        for adapter, init in by_adapter.items():
            if not (init is True or init is False or init == "gaussian"):
                raise ValueError(
                    f"The LoRA layer {path!r} (adapter {adapter!r}) asks for init_lora_weights={init!r}, "
                    f"which peft computes from the base weights when the adapter is created; a meta-built "
                    f"model has none then. Use True, False or 'gaussian', or build the model on the CPU. "
                    f"Received: init_lora_weights={init!r}"
                )
    return inits


def _unit_seed(seed: int, path: str) -> int:
    digest = hashlib.sha256(f"{seed}:{canonical_name(path)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _post_order(module: nn.Module, prefix: str):
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def initialise_unit(unit: Unit, plan: MaterializePlan) -> dict[str, torch.Tensor]:
    """The unit's tensors, whole, on the CPU, as its initialisers make them.

    Built on a copy of the meta shadow: ``to_empty`` works in place, and the plan (kept as long as
    the model's hooks keep it) would otherwise hold every unit's CPU copy, a whole model's worth
    (a LoRA block's full-size frozen base included, though ``weights=`` fills it)."""
    shadow = copy.deepcopy(unit.shadow).to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*shadow.parameters(), *shadow.buffers()]:
            tensor.fill_(math.nan if tensor.is_floating_point() else 0)  # what no initialiser set stays NaN
            if hasattr(tensor, "_is_hf_initialized"):
                del tensor._is_hf_initialized  # a flag copied from the meta build would make transformers skip it
    local_prefix = f"{unit.path}." if unit.path else ""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(_unit_seed(plan.seed, unit.path))
        for local, module in _post_order(shadow, ""):
            full_path = canonical_name(local_prefix + local if local else unit.path)
            owner = plan.initialiser_of.get(full_path)
            if is_lora_layer(module):  # after its children (post-order): peft's values win over _init_weights'
                _init_lora_layer(module, plan.lora_inits.get(full_path, {}))
            elif owner is not None:
                owner._init_weights(module)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    out = {}
    for name, tensor in [
        *shadow.named_parameters(remove_duplicate=False),
        *shadow.named_buffers(remove_duplicate=False),
    ]:
        full = local_prefix + name
        if full in unit.names:
            if tensor.is_floating_point() and bool(torch.isnan(tensor).any()):
                raise ValueError(
                    f"No initialiser sets {full!r} of this meta-built model (its module has no "
                    f"reset_parameters and no transformers _init_weights covers it). Give weights=, "
                    f"define reset_parameters, or build the model on the CPU."
                )
            out[full] = tensor.detach()
    return out


def _init_lora_layer(layer: nn.Module, inits: dict[str, object]) -> None:
    """What peft's ``update_layer`` does to a new adapter: build ``lora_A`` / ``lora_B`` (``nn.Linear``'s
    ``reset_parameters``), then ``reset_lora_parameters`` (``init_lora_weights=True``: A Kaiming, B zero)."""
    for adapter in layer.lora_A.keys():
        for factor in (layer.lora_A[adapter], layer.lora_B[adapter]):
            if callable(getattr(factor, "reset_parameters", None)):
                factor.reset_parameters()
        layer.reset_lora_parameters(adapter, inits.get(adapter, True))
