"""ModelParallel -> torch tensor-parallel styles on the model axis, local activations, reduced gradients.

Order, and why:
1. read every parameter's layout and build the plan (``tp_plan``), so a bad layout raises
   ValueError before any collective;
2. move the model to this process's device and broadcast every parameter and buffer from the
   first process, as DDP does: replicas and shards then start from one source of truth, even
   when each process initialised its own copy differently;
3. apply torch's ``ColwiseParallel`` / ``RowwiseParallel`` (``tp_styles``) to the sharded
   Linear / Conv1D / Embedding layers and DTensor propagation inside any other sharded module;
   everything else, and every activation, stays a plain local tensor, so code that creates
   tensors inside ``forward`` (position ids, rotary tables, masks) runs unchanged;
4. without ZeRO, average gradients over the batch axis (``DataAxisGradReducer``); with ZeRO,
   FSDP2 does it (``parallelize`` applies it after this).

A batch is this process's slice of the global batch (shared by the processes of one model-axis
group), as under DDP: the loss is a per-process mean and gradients are averaged.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainmesh import runtime

from .data_axis_grads import DataAxisGradReducer, no_grad_sync
from .mesh import to_torch_mesh
from .tp_plan import build_tp_plan, describe_plan, layer_kind
from .vocab_parallel import VocabShards, head_path

__all__ = ["apply_model_parallel", "batch_to_local", "no_grad_sync", "parameter_layouts"]


def parameter_layouts(model: nn.Module, distribution, skip_paths=frozenset()) -> dict[str, tuple]:
    """Path -> layout axes of every sharded parameter, tied aliases included (validated, no collective).
    ``skip_paths``: parameters laid out elsewhere (experts: ``expert_parallel.py``)."""
    by_id: dict[int, tuple] = {}
    for path, param in model.named_parameters():  # canonical names: what the layout map is keyed on
        if path in skip_paths:
            continue
        if isinstance(param, DTensor):
            raise ValueError(f"Parameter {path!r} is already a DTensor; distribute_model applies once.")
        layout = distribution.get_variable_layout((path, param))  # raises on a bad axis or divisibility
        if any(axis is not None for axis in layout.axes):
            by_id[id(param)] = layout.axes
    return {path: by_id[id(p)] for path, p in model.named_parameters(remove_duplicate=False) if id(p) in by_id}


def _warn_unmatched_keys(model: nn.Module, distribution) -> None:
    """A LayoutMap key that names nothing is most likely a typo; Keras ignores it silently, and an
    error would break Keras scripts that carry keys for other models: warn, naming the key."""
    import re

    paths = [p for p, _ in model.named_parameters(remove_duplicate=False)]
    paths += [f"{m}/output" for m, _ in model.named_modules() if m]
    for key in getattr(distribution, "layout_map", {}) or {}:
        if not any(key == path or re.fullmatch(key, path) for path in paths):
            warnings.warn(
                f"The LayoutMap key {key!r} matches no parameter (or '<module>/output') of "
                f"{type(model).__name__}; it is ignored. Parameter paths look like {paths[:3]}.",
                UserWarning,
                stacklevel=4,
            )


def _warn_unused_output_layouts(model: nn.Module, distribution) -> None:
    """``<module>/output`` layouts are sharding hints (Keras: ``with_sharding_constraint``). Activations
    here are local slices of the batch, which is what a batch-axis hint asks; others are ignored."""
    batch = distribution.batch_dim_name
    for module_path, _ in model.named_modules():
        layout = distribution.get_tensor_layout(f"{module_path}/output") if module_path else None
        if layout is None:
            continue
        if any(axis is not None and not (dim == 0 and axis == batch) for dim, axis in enumerate(layout.axes)):
            warnings.warn(
                f"The layout for '{module_path}/output' {layout.axes} is a sharding hint that trainmesh "
                f"does not need: activations stay local to each process (its slice of the batch), and "
                f"tensor-parallel layers communicate on their own. It is ignored.",
                UserWarning,
                stacklevel=4,
            )


def _broadcast_from_first(model: nn.Module) -> None:
    """One broadcast per dtype of all parameters and buffers flattened (not one per tensor: a
    transformer has hundreds, and each broadcast pays a round trip)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:  # tied weights once
            seen.add(id(tensor))
            by_dtype.setdefault(tensor.dtype, []).append(tensor.data)
    with torch.no_grad():
        for tensors in by_dtype.values():
            flat = _flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=0)
            for tensor, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                tensor.copy_(value)


def apply_model_parallel(
    model: nn.Module,
    distribution,
    *,
    reduce_grads: bool = True,
    whole_model: bool = True,
    fill=None,
    skip_paths=frozenset(),
) -> nn.Module:
    """Shard ``model`` in place per ``distribution``'s layout map; returns the same module.

    ``fill`` (``materialize.prepare``'s plan) fills a meta-built model here, after its layout and
    before the gradient hooks hold its parameters. ``reduce_grads=False`` leaves gradient averaging over the batch axis to FSDP2 (ZeRO 2-3) or to
    the pipeline runner. ``whole_model=False`` (a pipeline stage) skips step 2, since the whole model
    was broadcast before it was split, and the warning about keys matching nothing (a stage holds
    some layers only; the whole model was checked).
    """
    from .materialize import has_meta_tensors
    from .partial_grads import apply_grad_allreduce_modules
    from .tp_styles import DTensorBoundary, LayoutColwise, LayoutRowwise, share_block_input

    if not isinstance(model, nn.Module):
        raise TypeError(f"distribute_model expects a torch.nn.Module. Received: {type(model).__name__}")
    mesh = distribution.device_mesh
    batch_axis = distribution.batch_dim_name
    pipeline = getattr(distribution, "pipeline", None)
    sequence_axis = distribution.sequence.axis if distribution.sequence is not None else None
    model_axes = [
        a for a in mesh.axis_names if a not in (batch_axis, sequence_axis) and (pipeline is None or a != pipeline.axis)
    ]
    layouts = parameter_layouts(model, distribution, skip_paths)  # 1. everything validated, no collective yet
    plans = build_tp_plan(
        model,
        layouts,
        batch_axis=batch_axis,
        model_axes=model_axes,
        axis_sizes={a: mesh.axis_size(a) for a in mesh.axis_names},
    )
    if whole_model:
        _warn_unmatched_keys(model, distribution)
    _warn_unused_output_layouts(model, distribution)
    torch_mesh = to_torch_mesh(mesh)
    if not has_meta_tensors(model):  # a meta-built model is laid out first, filled after (materialize.py)
        model.to(runtime.local_torch_device())
        if whole_model:
            _broadcast_from_first(model)  # 2.

    sequence_parallel = getattr(distribution, "sequence_parallel", False)  # checked by ModelParallel
    if sequence_parallel:
        from .sequence_parallel import adjust_style, apply_sequence_parallel, gather_block_input
    if plans:  # 3.
        model_mesh = torch_mesh[tuple(model_axes)] if len(model_axes) > 1 else torch_mesh[model_axes[0]]
        units = set(_units_with_shared_input(plans))
        shared: dict[int, nn.Parameter] = {}
        head = head_path(model, plans) if len(model_axes) == 1 else None
        if head is not None:  # its output stays sharded when the loss runs on the shards (vocab_parallel.py)
            model._trainmesh_vocab_shards = VocabShards(head)
        for plan in plans.values():
            module = model.get_submodule(plan.path)
            placements = {name: _placements_on(axes, model_axes) for name, axes in plan.axes.items()}
            if plan.style == "colwise":
                keep = model._trainmesh_vocab_shards if plan.path == head else None
                style = LayoutColwise(placements, shared, gather_output=plan.gather_output, keep_shards=keep)
            elif plan.style == "rowwise":
                style = LayoutRowwise(
                    placements, shared, sharded_input=plan.sharded_input, embedding=layer_kind(module) == "embedding"
                )
            else:
                style = DTensorBoundary(placements, shared)
            if sequence_parallel:  # the residual stream sharded over the sequence (sequence_parallel.py)
                style = adjust_style(style, plan, units, embedding=layer_kind(module) == "embedding")
            style._apply(module, model_mesh)
        for parent in units:
            (gather_block_input if sequence_parallel else share_block_input)(model.get_submodule(parent), model_mesh)
        if sequence_parallel:
            apply_sequence_parallel(model, plans, units, model_mesh)
        # replicated parameters that see only this process's heads (Qwen3's q_norm / k_norm): their
        # gradients are summed over the model axis (partial_grads.py)
        apply_grad_allreduce_modules(model, plans, model_mesh)
    model._trainmesh_tp_plan = describe_plan(plans)
    if fill is not None:  # a meta-built model with no FSDP2 to follow: filled before hooks hold its parameters
        from .materialize import materialize

        materialize(model, fill, runtime.local_torch_device())

    dp_size = distribution.data_parallel_size
    if sequence_axis is not None:  # a sequence axis: gradients averaged over data x seq (context_parallel.py)
        from .context_parallel import gradient_group

        group, dp_size = gradient_group(torch_mesh, distribution)
    elif reduce_grads and dp_size > 1:
        group = torch_mesh.get_group(batch_axis) if torch_mesh.ndim > 1 else torch_mesh.get_group()
    if reduce_grads and dp_size > 1:  # 4.
        model._trainmesh_grad_reducer = DataAxisGradReducer(model, group, dp_size)
    model.register_forward_pre_hook(
        lambda module, args, kwargs: (batch_to_local(args, distribution), batch_to_local(kwargs, distribution)),
        with_kwargs=True,
    )
    model._trainmesh_distribution = distribution
    return model


def _units_with_shared_input(plans) -> list[str]:
    """Parents whose input feeds two or more paired column-wise projections (q/k/v, gate/up)."""
    counts: dict[str, int] = {}
    for plan in plans.values():
        if plan.style == "colwise" and not plan.gather_output and "." in plan.path:
            parent = plan.path.rsplit(".", 1)[0]
            counts[parent] = counts.get(parent, 0) + 1
    return [parent for parent, n in counts.items() if n >= 2]


def _placements_on(axes: tuple, model_axes: list[str]) -> list:
    """One placement per model axis: ``Shard(dim)`` where the layout names it (the batch axis carries
    no parameter shard: ``build_tp_plan`` refused that)."""
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(axes.index(axis)) if axis in axes else Replicate() for axis in model_axes]


def batch_to_local(batch: Any, distribution) -> Any:
    """This process's rows of every DTensor in ``batch`` (a global batch from an older script, or
    outputs), plain tensors as they are."""
    if isinstance(batch, DTensor):
        if batch.dim() == 0:
            return batch.full_tensor()
        from torch.distributed.tensor import Replicate, Shard

        torch_mesh = batch.device_mesh
        names = torch_mesh.mesh_dim_names or ()
        placements = [Shard(0) if name == distribution.batch_dim_name else Replicate() for name in names]
        if len(placements) != torch_mesh.ndim:
            placements = [Replicate()] * torch_mesh.ndim
        return batch.redistribute(torch_mesh, placements).to_local()
    if isinstance(batch, (tuple, list)):
        return type(batch)(batch_to_local(item, distribution) for item in batch)
    if isinstance(batch, dict):
        return {key: batch_to_local(item, distribution) for key, item in batch.items()}
    return batch
