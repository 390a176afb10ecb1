"""From a ModelParallel layout map to a per-module tensor-parallel plan (no collective, no mutation).

Activations stay local to a process (its slice of the batch, whole over the model axis) and
only the modules whose parameters the layout map shards talk over the model axis. Each such
module gets one of three treatments:

* ``colwise``: a Linear whose weight (out, in) is ``("model", None)``, a transformers
  ``Conv1D`` whose weight (in, out) is ``(None, "model")``, or an Embedding whose weight is
  ``(None, "model")``: torch's ``ColwiseParallel``. Its output stays sharded over its last dim
  (Megatron: no communication) when a row-wise sibling in the same parent consumes it, else it
  is all-gathered so that the parent's code sees the whole tensor.
* ``rowwise``: a Linear ``(None, "model")``, a Conv1D ``("model", None)`` or an Embedding
  ``("model", None)`` (vocab-parallel): torch's ``RowwiseParallel``, output all-reduced.
* ``dtensor``: any other sharded module: its parameters become DTensors with exactly the
  layout's placements, its inputs enter as replicated DTensors and its outputs leave as whole
  local tensors (DTensor propagation inside the module only).

A column-wise layer counts as *paired* (output kept sharded) only when its output is no wider
than a row-wise sibling's input: a fused projection (GPT-2's ``c_attn``, 3 x hidden wide) is
split by the parent's own code at hard-wired offsets, which a shard would break, so its output
is gathered instead. Sharded attention projections must split into whole heads per process.

peft's LoRA layers: ``base_layer`` and the adapters ``lora_A.<name>`` / ``lora_B.<name>`` are each
planned as the Linear they are, and count as siblings at the LoRA layer's own place
(``adapters.layer_path``): a column-wise ``lora_B`` is gathered or kept sharded exactly as its
base, a row-wise ``lora_A`` reads the same (sharded or whole) input as its base.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from trainmesh.distribution.adapters import layer_path

STYLES = ("colwise", "rowwise", "dtensor")


@dataclass
class ModulePlan:
    path: str
    style: str  # one of STYLES
    axes: dict[str, tuple]  # parameter name -> layout axes (every parameter of the module)
    gather_output: bool = False  # colwise: all-gather the output (not consumed by a rowwise sibling)
    sharded_input: bool = False  # rowwise: input arrives sharded over its last dim (from a paired colwise)
    notes: list[str] = field(default_factory=list)


def layer_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    # transformers' Conv1D (GPT-2): a Linear with its weight stored (in, out). Matched by its
    # name and shape so transformers need not be imported.
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None:
        return "conv1d"
    return None


def _out_features(module: nn.Module, kind: str) -> int:
    return {"linear": lambda m: m.out_features, "conv1d": lambda m: m.nf, "embedding": lambda m: m.embedding_dim}[kind](
        module
    )


def _in_features(module: nn.Module, kind: str) -> int:
    return {"linear": lambda m: m.in_features, "conv1d": lambda m: m.nx, "embedding": lambda m: m.num_embeddings}[kind](
        module
    )


def _style_of(kind: str | None, axes: dict[str, tuple], model_axis: str | None) -> str:
    """colwise / rowwise when the layouts are exactly one of torch's styles, else dtensor."""
    if kind is None or model_axis is None:
        return "dtensor"
    weight = axes.get("weight")
    bias = axes.get("bias")
    shard_out = {"linear": (model_axis, None), "conv1d": (None, model_axis), "embedding": (None, model_axis)}[kind]
    shard_in = {"linear": (None, model_axis), "conv1d": (model_axis, None), "embedding": (model_axis, None)}[kind]
    if weight == shard_out and bias in (None, (None,), (model_axis,)):
        return "colwise"  # an unset or replicated bias follows its weight's output shards
    if weight == shard_in and bias in (None, (None,)):
        return "rowwise"
    return "dtensor"


def build_tp_plan(
    model: nn.Module,
    layouts: dict[str, tuple],
    *,
    batch_axis: str | None,
    model_axes: list[str],
    axis_sizes: dict[str, int],
) -> dict[str, ModulePlan]:
    """``layouts``: parameter path -> layout axes, for every parameter the layout map shards.

    Raises ValueError for a parameter sharded over the batch axis (that is ZeRO's work) and for
    attention projections whose heads do not split evenly. Returns module path -> plan.
    """
    for path, axes in layouts.items():
        if batch_axis is not None and batch_axis in axes:
            raise ValueError(
                f"The layout for {path!r} shards it over the batch axis {batch_axis!r}. ModelParallel shards "
                f"parameters over the model axes only; sharding them over the batch axis is ZeRO's work: pass "
                f"zero_stage=3 (or 2) and lay the parameter out over the model axes. Received: {path!r}={axes!r}"
            )
    model_axis = model_axes[0] if len(model_axes) == 1 else None  # torch's styles take a 1-D mesh
    owners: dict[str, dict[str, tuple]] = {}
    for module_path, module in model.named_modules():
        own = {
            name: layouts.get(f"{module_path}.{name}" if module_path else name)
            for name, _ in module.named_parameters(recurse=False)
        }
        if any(axes is not None for axes in own.values()):
            owners[module_path] = {n: a for n, a in own.items() if a is not None}
    plans: dict[str, ModulePlan] = {}
    for module_path, axes in owners.items():
        module = model.get_submodule(module_path)
        kind = layer_kind(module)
        style = _style_of(kind, axes, model_axis)
        if style == "colwise" and getattr(module, "bias", None) is not None:
            axes["bias"] = (model_axis,)  # the bias of a column shard is that shard's slice
        plans[module_path] = ModulePlan(module_path, style, axes)
    _pair_siblings(model, plans)
    _check_heads(model, plans, axis_sizes.get(model_axis, 1) if model_axis else 1)
    return plans


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _unit_parent(model: nn.Module, path: str) -> str:
    """The module whose code consumes ``path``'s output: its parent, seen through peft's LoRA layers."""
    return _parent(layer_path(model, path))


def _pair_siblings(model: nn.Module, plans: dict[str, ModulePlan]) -> None:
    by_parent: dict[str, list[ModulePlan]] = {}
    for plan in plans.values():
        by_parent.setdefault(_unit_parent(model, plan.path), []).append(plan)
    for siblings in by_parent.values():
        rows = [p for p in siblings if p.style == "rowwise" and layer_kind(model.get_submodule(p.path)) != "embedding"]
        for plan in siblings:
            if plan.style != "colwise":
                continue
            module = model.get_submodule(plan.path)
            kind = layer_kind(module)
            width = _out_features(module, kind)
            paired = kind != "embedding" and any(
                width <= _in_features(model.get_submodule(r.path), layer_kind(model.get_submodule(r.path)))
                for r in rows
            )
            plan.gather_output = not paired
            if not paired:
                plan.notes.append("output all-gathered (no row-wise sibling consumes it as it is)")
        paired_widths = [p for p in siblings if p.style == "colwise" and not p.gather_output]
        for plan in rows:
            plan.sharded_input = bool(paired_widths)


def _check_heads(model: nn.Module, plans: dict[str, ModulePlan], model_size: int) -> None:
    """Sharded q/k/v projections must give every process whole heads (GQA: whole KV heads)."""
    if model_size <= 1:
        return
    for plan in plans.values():
        if plan.style != "colwise" or plan.gather_output:
            continue
        parent = model.get_submodule(_unit_parent(model, plan.path))
        head_dim = getattr(parent, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim <= 0:
            continue
        module = model.get_submodule(plan.path)
        width = _out_features(module, layer_kind(module))
        heads = width // head_dim
        if width % head_dim == 0 and heads % model_size:
            raise ValueError(
                f"{plan.path!r} holds {heads} attention heads (width {width}, head_dim {head_dim}), which do not "
                f"split over the model axis of size {model_size}. Use a model axis that divides {heads} (for "
                f"grouped-query attention, the number of KV heads), or leave this projection unsharded. "
                f"Received: model axis size={model_size}"
            )


def describe_plan(plans: dict[str, ModulePlan]) -> list[str]:
    """One line per sharded module, for logs and ``LayoutMap.auto``'s printout."""
    lines = []
    for plan in plans.values():
        extra = f" ({'; '.join(plan.notes)})" if plan.notes else ""
        lines.append(f"{plan.path}: {plan.style} {dict(plan.axes)}{extra}")
    return lines
