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
    tensor = torch.as_tensor(value).detach().to(torch.float64).reshape(1)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return float(all_reduce_small(tensor)[0]) / world


def all_reduce_small(values: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce a small CPU vector (losses, flags, norms) over every process; returned on the CPU.
    A no-op on one process. (:func:`all_reduce_small_async`, waited for at once.)"""
    return all_reduce_small_async(values, op)()


def all_reduce_small_async(values: torch.Tensor, op=dist.ReduceOp.SUM):
    """Start reducing a small CPU vector over every process and return ``wait() -> reduced CPU
    vector``: the reduction runs on the process group's own threads (or stream) while the caller
    goes on. The one place that knows a pure-NCCL group needs it on the GPU (a mixed
    "cpu:gloo,cuda:nccl" group takes it as it is). A no-op on one process.
    """
    if _one_process():
        return lambda: values
    tensor = values.cuda() if dist.get_backend() == "nccl" else values
    work = dist.all_reduce(tensor, op=op, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return tensor.cpu()

    return wait


def all_reduce_floats_async(values: list[float]):
    """As :func:`all_reduce_small_async` for a short list of Python floats (summed in float64):
    ``wait() -> list of floats``. On one process the list itself comes back, with no tensor made:
    the Trainer's per-step check runs this every step."""
    if _one_process():
        return lambda: values
    wait = all_reduce_small_async(torch.tensor(values, dtype=torch.float64))
    return lambda: wait().tolist()


def _one_process() -> bool:
    """No process group, or one of one process: a reduction is the value itself."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1


def gather_batches(local_outputs: list, distribution) -> list[torch.Tensor]:
    """Every batch's full outputs, in order, on every process.

    ``local_outputs[b]`` is this process's share of batch b: a DTensor (already global), a
    plain tensor of its rows, or None when its share was empty. Plain shares are exchanged
    once, at the end, over the batch axis and concatenated in data-index order (the order
    ``covering_parts`` hands rows out).
    """
    if all(isinstance(o, DTensor) for o in local_outputs):
        return [o.full_tensor().detach().cpu() for o in local_outputs]
    local = [None if o is None else o.detach().cpu() for o in local_outputs]
    dp = distribution.data_parallel_size
    if dp == 1:
        return local
    from .mesh import to_torch_mesh

    group = to_torch_mesh(distribution.device_mesh).get_group(distribution.batch_dim_name)
    shares: list = [None] * dp
    dist.all_gather_object(shares, local, group=group)
    return [torch.cat([share[b] for share in shares if share[b] is not None]) for b in range(len(local))]
