"""``LayoutMap.auto(model, mesh)``: a tensor-parallel layout for a model nobody wrote one for.

1. A model that ships its own plan (transformers: ``config.base_model_tp_plan`` for the base
   model, the class's ``_tp_plan`` for the head) gets that plan, translated to layouts:
   "colwise" -> weight ``(model, None)``, "rowwise" -> ``(None, model)`` (torch's Linear
   weights are out x in). "replicated_with_grad_allreduce" modules (Qwen3's q/k norms) stay
   replicated and ``_torch/partial_grads.py`` sums their partial gradients over the model axis.
   Entries of other kinds (sequence parallel, expert parallel, ...) are left out, and said so.
2. Otherwise the plan is derived from the module tree: inside each repeated block, a module
   with two or more Linear/Conv1D children is an attention or MLP unit whose last child is the
   output projection (row-wise) and whose other children are input projections (column-wise),
   as Megatron splits them; the largest Embedding and a top-level head as wide as it are
   vocab-parallel; norms and everything else stay replicated.

A peft model (``peft.get_peft_model``) gets its base model's plan: the transformers model is found
under ``base_model.model``, a planned module that is a LoRA layer is laid out through its
``base_layer``, and its adapters follow (``adapters.adapter_layouts``).

Every proposed entry is checked against the axis size (a dimension that does not divide, or
attention heads that do not split) and dropped with a note when it fails. The plan is printed
(by the first process) so the user can copy it into an explicit LayoutMap.

Pure description: only module types and shapes are read; nothing is distributed here.
"""

from __future__ import annotations

import os
import re

from torch import nn

from .adapters import adapter_layouts, base_of, is_lora_layer, linear_kind
from .layout import LayoutMap
from .mesh import DeviceMesh


def _weight_axes(kind: str, style: str, axis: str) -> tuple:
    colwise = style == "colwise"
    if kind == "conv1d":
        return (None, axis) if colwise else (axis, None)
    return (axis, None) if colwise else (None, axis)


def _hf_pattern(prefix: str, key: str) -> str:
    escaped = re.escape(key).replace(r"\*", r"\d+")
    return (re.escape(prefix) + r"\." if prefix else "") + escaped


def _transformers_root(model: nn.Module) -> tuple[str, nn.Module]:
    """The outermost transformers model in ``model`` (itself, or under peft's ``base_model.model``)."""
    for path, module in model.named_modules():
        if any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__):
            return path, module
    return "", model


def _from_shipped_plan(model: nn.Module, axis: str, notes: list[str]) -> dict[str, str] | None:
    root_path, root = _transformers_root(model)
    config = getattr(root, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None) or {}
    head_plan = getattr(type(root), "_tp_plan", None) or {}
    if not base_plan:
        return None
    prefix = getattr(root, "base_model_prefix", "") or ""
    if prefix and not hasattr(root, prefix):
        prefix = ""  # the model is the base model itself
    prefix = ".".join(p for p in (root_path, prefix) if p)
    styles: dict[str, str] = {}
    for plan, plan_prefix in ((base_plan, prefix), (head_plan, root_path)):
        for key, style in plan.items():
            kind = {"colwise": "colwise", "colwise_gather_output": "colwise", "rowwise": "rowwise"}.get(style)
            if kind is None:
                if style == "replicated_with_grad_allreduce":  # stays replicated; _torch/partial_grads.py
                    notes.append(f"{key}: replicated, its partial gradients summed over the model axis")
                else:
                    notes.append(f"{key}: {style!r} left out (trainmesh applies colwise and rowwise entries)")
                continue
            styles[_hf_pattern(plan_prefix, key)] = kind
    return styles


def _in_block(path: str) -> bool:
    return any(part.isdigit() for part in path.split("."))


def _derived_plan(model: nn.Module, notes: list[str]) -> dict[str, str]:
    styles: dict[str, str] = {}
    for path, module in model.named_modules():
        children = [(name, child) for name, child in module.named_children() if linear_kind(child)]
        if len(children) < 2 or not _in_block(path):
            continue
        *inputs, (last, _) = children
        for name, _ in inputs:
            styles[re.escape(f"{path}.{name}")] = "colwise"
        styles[re.escape(f"{path}.{last}")] = "rowwise"
    embeddings = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        path, table = max(embeddings, key=lambda pm: pm[1].num_embeddings)
        styles[re.escape(path)] = "vocab"
        root_path, root = _transformers_root(model)  # a peft model's head sits under base_model.model
        for head_name, head in root.named_children():
            head_path = f"{root_path}.{head_name}" if root_path else head_name
            if linear_kind(head) == "linear" and base_of(head).out_features == table.num_embeddings:
                styles[re.escape(head_path)] = "colwise"
    if not styles:
        notes.append("no repeated block with Linear/Conv1D units and no embedding: everything stays replicated")
    return styles


def _check(model: nn.Module, pattern: str, style: str, axis: str, size: int, notes: list[str]) -> dict[str, tuple]:
    """The parameter layouts of the modules ``pattern`` matches, or {} (with a note) if any fails."""
    layouts: dict[str, tuple] = {}
    for path, module in model.named_modules():
        if not re.fullmatch(pattern, path):
            continue
        if isinstance(module, nn.Embedding):
            if module.num_embeddings % size:
                notes.append(f"{path}: {module.num_embeddings} rows do not divide over {axis}={size}; replicated")
                return {}
            layouts[f"{path}.weight"] = (axis, None)
            continue
        kind = linear_kind(module)
        if kind is None:
            continue
        base = base_of(module)
        width = base.out_features if kind == "linear" else base.nf
        depth = base.in_features if kind == "linear" else base.nx
        split = width if style == "colwise" else depth
        head_dim = getattr(model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model, "head_dim", None)
        if split % size:
            notes.append(f"{path}: {style} does not split evenly over {axis}={size} (width {split}); replicated")
            return {}
        if (
            style == "colwise"
            and isinstance(head_dim, int)
            and head_dim > 0
            and width % head_dim == 0
            and (width // head_dim) % size
        ):
            notes.append(f"{path}: its {width // head_dim} heads do not split over {axis}={size}; replicated")
            return {}
        if is_lora_layer(module):  # the plan names peft's layer: its base and adapters are laid out together
            layouts[f"{path}.base_layer.weight"] = _weight_axes(kind, style, axis)
            layouts.update(adapter_layouts(path, module, style, axis))
        else:
            layouts[f"{path}.weight"] = _weight_axes(kind, style, axis)
    return layouts


# Axis names a pipeline runs over (``tm.Pipeline(axis="pipe")``'s default and the planner's names): such an
# axis splits layers, never tensors, so it is never the default tensor-parallel axis.
PIPE_AXIS_NAMES = ("pipe", "pp", "pipeline")
# Axis names a sequence is split over (``sequence_dim_name``; the planner's names): never the default
# tensor-parallel axis either, so ``("data", "seq")`` gets none.
SEQUENCE_AXIS_NAMES = ("seq", "cp", "context")
MODEL_AXIS_NAMES = ("model", "tensor", "tp")


def default_model_axis(device_mesh: DeviceMesh) -> str | None:
    """The mesh's last axis that is not a pipe or sequence axis, when it is named as a model axis or another
    such axis (the batch axis, first by Keras's convention) precedes it; else None: ``("data",)``,
    ``("pipe", "data")`` and ``("data", "seq")`` have no model axis, so they get no tensor parallelism
    (taking "data" would shard over the batch axis), while ``("pipe", "model")`` and ``("data", "mp")`` do."""
    names = [a for a in device_mesh.axis_names if a not in PIPE_AXIS_NAMES + SEQUENCE_AXIS_NAMES]
    if names and (len(names) > 1 or names[-1] in MODEL_AXIS_NAMES):
        return names[-1]
    return None


def auto_layout_map(
    model: nn.Module,
    device_mesh: DeviceMesh,
    *,
    model_axis: str | None = None,
    verbose: bool = True,
    expert_axis: str | None = None,
    expert_parallel_size: int | None = None,
) -> LayoutMap:
    """See the module docstring. ``model_axis`` defaults to the mesh's last axis other than a pipe axis
    (the first is the batch axis, Keras's convention; ``default_model_axis``); a mesh with one axis
    besides a pipe axis gets no tensor-parallel entries (pure data parallelism, with a pipeline or not).
    ``expert_axis`` adds the experts' layouts (``expert_layout.expert_layouts``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"LayoutMap.auto needs a torch.nn.Module. Received: {type(model).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"LayoutMap.auto needs a trainmesh DeviceMesh. Received: device_mesh={device_mesh!r}")
    layout_map = LayoutMap(device_mesh)
    if expert_axis is not None:  # experts over their own axis (expert_layout.py); checked before any TP entry
        from .expert_layout import expert_layouts

        experts, expert_notes, expert_source = expert_layouts(model, device_mesh, expert_axis, expert_parallel_size)
        layout_map.expert_parallel_size = expert_parallel_size
    if model_axis is None:
        model_axis = default_model_axis(device_mesh)
        if model_axis is None and expert_axis is None:
            return layout_map
    if model_axis is None:  # no model axis, with experts: expert entries only, dense layers replicated
        return _with_experts(model, layout_map, experts, expert_notes, expert_source, expert_axis, verbose)
    if model_axis not in device_mesh.axis_names:
        raise ValueError(
            f"model_axis {model_axis!r} is not an axis of the mesh {device_mesh.axis_names}. "
            f"Received: model_axis={model_axis!r}"
        )
    size = device_mesh.axis_size(model_axis)
    notes: list[str] = []
    shipped = _from_shipped_plan(model, model_axis, notes)
    source = "the model's own tensor-parallel plan" if shipped is not None else "derived from the module tree"
    styles = shipped if shipped is not None else _derived_plan(model, notes)
    # A unit (the projections of one attention or MLP module) is sharded whole or not at all: a
    # query projection split into heads beside unsplit keys would not even run.
    units: dict[str, list[tuple[str, str]]] = {}
    for pattern, style in styles.items():
        units.setdefault(pattern.rsplit(r"\.", 1)[0] if style != "vocab" else pattern, []).append((pattern, style))
    for unit, members in units.items():
        checked = [_check(model, pattern, style, model_axis, size, notes) for pattern, style in members]
        if len(members) > 1 and not all(checked):
            shown = unit.replace(r"\d+", "*").replace(chr(92), "")
            notes.append(f"{shown}: left replicated as a whole (a member does not split)")
            continue
        for layouts in checked:
            for path, axes in layouts.items():
                layout_map[re.escape(path)] = axes
    if verbose and os.environ.get("RANK", "0") == "0":
        print(f"[trainmesh] LayoutMap.auto for {type(model).__name__} ({source}), {model_axis}={size}:")
        for key in layout_map:
            print(f"  {key.replace(chr(92), '')}: {layout_map[key].axes}")
        for note in notes:
            print(f"  note: {note}")
    if expert_axis is not None:
        return _with_experts(model, layout_map, experts, expert_notes, expert_source, expert_axis, verbose)
    return layout_map


def _with_experts(
    model: nn.Module,
    layout_map: LayoutMap,
    experts: dict[str, tuple],
    notes: list[str],
    source: str,
    axis: str,
    verbose: bool,
) -> LayoutMap:
    """``layout_map`` plus one entry per expert parameter (replacing any TP entry of the same path), printed."""
    for path, axes in experts.items():
        key = re.escape(path)
        if key in layout_map:
            del layout_map[key]
        layout_map[key] = axes
    if verbose and os.environ.get("RANK", "0") == "0":
        size = layout_map.expert_parallel_size or layout_map.device_mesh.axis_size(axis)
        print(f"[trainmesh] LayoutMap.auto experts of {type(model).__name__} ({source}), {axis}={size}:")
        for path, axes in experts.items():
            print(f"  {path}: {axes}")
        for note in notes:
            print(f"  note: {note}")
    return layout_map
