"""ModelParallel -> DTensor parameters, output layouts and global (DTensor) batches.

Order, and why:
1. compute every placement first, so a bad layout raises ValueError before any collective;
2. move the model to this process's device, then turn each parameter into a DTensor with
   ``distribute_tensor`` (which scatters from the first process of each group, so
   replicas start identical and shards come from one source of truth);
3. hook every parameter so that its gradient is brought back to the parameter's own
   placements as soon as it is accumulated: ``Partial`` over the batch axis becomes an
   all-reduce (the data-parallel gradient reduction, overlapped with the rest of backward),
   and a gradient that arrived sharded differently is redistributed;
4. hook ``<module>/output`` layouts onto module outputs, and convert plain-tensor inputs of
   the root module into global batches (this process's slice of the batch axis).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainmesh import runtime
from trainmesh.distribution.layout import TensorLayout

from .dtensor_fixes import install_dtensor_fixes
from .mesh import to_placements, to_torch_mesh


def _parameter_placements(model: nn.Module, distribution) -> dict[int, tuple[str, list]]:
    plan: dict[int, tuple[str, list]] = {}
    for path, param in model.named_parameters(remove_duplicate=True):
        if isinstance(param, DTensor):
            raise ValueError(f"Parameter {path!r} is already a DTensor; distribute_model applies once.")
        layout = distribution.get_variable_layout((path, param))
        plan[id(param)] = (path, to_placements(layout, distribution.device_mesh))
    return plan


def _output_layouts(model: nn.Module, distribution) -> dict[str, Any]:
    layouts = {}
    for module_path, _ in model.named_modules():
        if module_path:
            layout = distribution.get_tensor_layout(f"{module_path}/output")
            if layout is not None:
                layouts[module_path] = layout
    return layouts


_grad_sync_enabled = [True]


@contextlib.contextmanager
def no_grad_sync() -> Iterator[None]:
    """Let gradients accumulate un-reduced (``Partial``) during non-final micro-steps, as DDP's
    ``no_sync`` does: the reduction then happens once, on the final micro-step's backward."""
    previous = _grad_sync_enabled[0]
    _grad_sync_enabled[0] = False
    try:
        yield
    finally:
        _grad_sync_enabled[0] = previous


def _bring_grad_to_param_placements(param: DTensor) -> None:
    grad = param.grad
    if not _grad_sync_enabled[0]:
        return
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def apply_model_parallel(model: nn.Module, distribution, *, reduce_grads: bool = True) -> nn.Module:
    """Shard ``model`` in place per ``distribution``'s layout map; returns the same module.

    ``reduce_grads=False`` leaves gradient reduction over the batch axis to someone else (FSDP2,
    when ZeRO shards the batch axis too).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"distribute_model expects a torch.nn.Module. Received: {type(model).__name__}")
    plan = _parameter_placements(model, distribution)  # 1. validate everything, no collective yet
    outputs = _output_layouts(model, distribution)
    install_dtensor_fixes()
    torch_mesh = to_torch_mesh(distribution.device_mesh)
    model.to(runtime.local_torch_device())

    converted: dict[int, nn.Parameter] = {}  # tied weights stay tied
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            key = id(param)
            if key not in converted:
                _, placements = plan[key]
                dparam = nn.Parameter(
                    distribute_tensor(param.detach(), torch_mesh, placements), requires_grad=param.requires_grad
                )
                if dparam.requires_grad and reduce_grads:
                    dparam.register_post_accumulate_grad_hook(_bring_grad_to_param_placements)
                converted[key] = dparam
            module.register_parameter(name, converted[key])

    for module_path, layout in outputs.items():
        module = model.get_submodule(module_path)
        module.register_forward_hook(_output_layout_hook(module_path, layout, distribution, torch_mesh))

    model.register_forward_pre_hook(lambda module, args: batch_to_global(args, distribution))
    model._trainmesh_distribution = distribution
    return model


def _output_layout_hook(path: str, layout, distribution, torch_mesh):
    def hook(module, inputs, output):
        if not isinstance(output, DTensor):
            raise TypeError(
                f"A layout is set for '{path}/output' but that module returned a plain "
                f"{type(output).__name__}; only DTensor outputs can be laid out."
            )
        layout.validate_for_shape(output.shape, f"{path}/output")
        return output.redistribute(torch_mesh, to_placements(layout, distribution.device_mesh))

    return hook


def batch_to_global(batch: Any, distribution, global_rows: int | None = None) -> Any:
    """Treat every plain tensor in ``batch`` as this process's slice of a global batch (DTensor).

    ``global_rows`` gives the global batch size when the slices are unequal (evaluation's last
    batch, split as DTensor's ``Shard`` splits: ``torch.chunk`` sizes); by default every
    process holds an equal slice.
    """
    if isinstance(batch, DTensor):
        return batch
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        torch_mesh = to_torch_mesh(distribution.device_mesh)
        rows = global_rows if global_rows is not None else batch.shape[0] * distribution.data_parallel_size
        global_shape = torch.Size((rows,) + tuple(batch.shape[1:]))
        if global_rows is None:
            layout = distribution.get_data_layout(global_shape)
        else:  # an uneven split is legitimate here; skip the divisibility check
            layout = TensorLayout((distribution.batch_dim_name,) + (None,) * (batch.dim() - 1), distribution.device_mesh)
        placements = to_placements(layout, distribution.device_mesh)
        local = batch.to(runtime.local_torch_device())
        return DTensor.from_local(local, torch_mesh, placements, run_check=False, shape=global_shape,
                                  stride=_contiguous_strides(global_shape))
    if isinstance(batch, (tuple, list)):
        return type(batch)(batch_to_global(item, distribution, global_rows) for item in batch)
    if isinstance(batch, dict):
        return {key: batch_to_global(item, distribution, global_rows) for key, item in batch.items()}
    return batch


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def batch_to_local(batch: Any, distribution) -> Any:
    """The inverse: this process's rows of every DTensor in ``batch`` (for metrics), plain tensors as they are."""
    if isinstance(batch, DTensor):
        if batch.dim() == 0:
            return batch.full_tensor()
        torch_mesh = to_torch_mesh(distribution.device_mesh)
        layout = TensorLayout((distribution.batch_dim_name,) + (None,) * (batch.dim() - 1), distribution.device_mesh)
        return batch.redistribute(torch_mesh, to_placements(layout, distribution.device_mesh)).to_local()
    if isinstance(batch, (tuple, list)):
        return type(batch)(batch_to_local(item, distribution) for item in batch)
    if isinstance(batch, dict):
        return {key: batch_to_local(item, distribution) for key, item in batch.items()}
    return batch
