"""Where this process's shard of a tensor sits in the full tensor: for code that fills shards
piece by piece (``materialize``: from files or initialisers) and code that streams full tensors
out one piece at a time (``checkpoint.hf_save``) without holding any of them whole.

A shard along dim 0 only (FSDP2's, a column-wise tensor-parallel weight, or both nested) is one
contiguous run of the full tensor's row-major elements, so a writer can place it at its byte
offset as it arrives. Any other layout (a row-wise tensor-parallel weight, FSDP2's strided shard
of a tensor-parallel dim 0) is gathered whole with ``full_tensor``.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def is_sharded(value: torch.Tensor) -> bool:
    """A DTensor (its full value may need the other processes of its mesh)."""
    return isinstance(value, DTensor)


def local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This process's piece of ``tensor``: the local tensor, its offset and shape in the global one."""
    if isinstance(tensor, DTensor):
        shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local = tensor.to_local()
        assert tuple(local.shape) == tuple(shape), (tensor.shape, tensor.placements, local.shape, shape)
        return local, tuple(offsets), tuple(shape)
    return tensor.detach(), (0,) * tensor.ndim, tuple(tensor.shape)


def flat_range(value: torch.Tensor) -> tuple[int, int] | None:
    """(first element, number of elements) of this process's part in the row-major full tensor, when
    that part is one contiguous run of it; else None. A plain tensor is all of itself."""
    if not isinstance(value, DTensor):
        return 0, value.numel()
    if any(not (type(p) is Replicate or (type(p) is Shard and p.dim == 0)) for p in value.placements):
        return None  # type(), not isinstance: _StridedShard's runs are interleaved
    if value.dim() == 0:
        return 0, 1
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(shape) != tuple(value.to_local().shape):
        return None
    return offset[0] * math.prod(value.shape[1:]), math.prod(shape)


def local_part(value: torch.Tensor) -> torch.Tensor:
    """This process's elements, flat, on the CPU, row-major (what ``flat_range`` describes)."""
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.detach().reshape(-1).cpu()


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over a DTensor's mesh), on the CPU."""
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
