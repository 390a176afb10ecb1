"""Turn per-process values (losses, metrics) into the number a one-device run reports."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_mean(value) -> float:
    """A DTensor already has global semantics; a plain per-process mean is averaged over processes.

    Averaging over every process (not only the batch axis) is still exact: processes that
    share a data index hold the same value, so each index is counted equally often.
    """
    if isinstance(value, DTensor):
        return float(value.full_tensor().detach().item())
    tensor = torch.as_tensor(value).detach().to(torch.float64)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return float(tensor.item())
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return float(tensor.item()) / dist.get_world_size()
