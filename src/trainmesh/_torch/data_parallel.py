"""DataParallel -> torch ``DistributedDataParallel`` over the batch axis."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainmesh import runtime

from .mesh import to_torch_mesh


class _BufferSyncOutsideAutocast(DistributedDataParallel):
    """DDP whose per-forward buffer broadcast runs with autocast off.

    DDP broadcasts buffers at the start of ``forward``, so inside the Trainer's autocast region.
    The broadcast flattens them with a ``cat``, an autocast "promote" op, which refuses a 16-bit
    dtype other than autocast's own: an fp16 base (its rotary ``inv_freq`` buffers fp16) under
    bf16-mixed failed with "Unexpected floating ScalarType in at::autocast::prioritize". A broadcast
    only copies bytes, so turning autocast off there changes no value (an fp32 model's buffers are
    fp32 either way)."""

    def _sync_buffers(self):
        with torch.autocast(device_type=self.device_type, enabled=False):
            return super()._sync_buffers()


def apply_data_parallel(model: nn.Module, distribution, **ddp_kwargs) -> nn.Module:
    """Move ``model`` to this process's device and wrap it in DDP over the batch axis.

    DDP broadcasts parameters and buffers from the first process at construction, so every
    replica starts identical, and all-reduces gradients in buckets while backward runs. With a
    batch axis of one process there is nothing to average: the model is returned unwrapped
    (DDP would still copy every gradient into its buckets and back, ~20% of a small step).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"distribute_model expects a torch.nn.Module. Received: {type(model).__name__}")
    if isinstance(model, DistributedDataParallel):
        raise ValueError("The model is already wrapped in DistributedDataParallel; pass the plain module.")
    torch_mesh = to_torch_mesh(distribution.device_mesh)
    device = runtime.local_torch_device()
    model.to(device)
    if torch_mesh.ndim > 1:
        # DDP syncs only inside its own group; start every group from the same weights.
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor.data, src=0)
    if getattr(distribution, "sequence", None) is not None:  # a sequence axis: average over data x seq
        from .context_parallel import gradient_group

        group = gradient_group(torch_mesh, distribution)[0]
    elif distribution.data_parallel_size == 1 and torch_mesh.ndim == 1:
        return model
    else:
        group = torch_mesh.get_group(distribution.batch_dim_name)
    device_ids = [device.index] if device.type == "cuda" else None
    # Gradients as views into DDP's buckets: one copy of the gradients instead of two (4P bytes
    # saved in fp32; measured in benchmarks/zero_memory.py).
    ddp_kwargs.setdefault("gradient_as_bucket_view", True)
    return _BufferSyncOutsideAutocast(model, device_ids=device_ids, process_group=group, **ddp_kwargs)
