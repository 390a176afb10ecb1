"""FSDP2's reduce-scatter carried by an all-reduce, for gloo (ZeRO stages 1-3 on CPU processes).

gloo's ``reduce_scatter_single`` moves the same bytes as its ring all-reduce of the whole input
(measured on 4 processes: 1.5x the input's bytes sent per rank by both, the ring all-reduce's
``2 (N-1)/N``) but takes about 3x as long (16 MB fp32: 78 ms against 26 ms; 4 MB: 24 ms against
10 ms). FSDP2 calls it once per unit in every backward, with the backward blocked until it
returns, so on gloo it set ZeRO's step time. Here the unit's flat reduce-scatter input (``N``
equal rows, row ``j`` the slices rank ``j`` owns) is all-reduced in place, and this rank's row is
copied out: the same sum, the same bytes on the wire, a third of the time.

Checked again on torch 2.14.1 for the first step from a checkpoint (issue 47): gloo's
``reduce_scatter_tensor`` (the deprecated name of ``reduce_scatter_single``) runs and gives rows
bit-identical to this carry's and across runs, but on 4 processes it took 43 ms against the carry's
24 ms for 4 MB of fp32 and 412 ms against 157 ms for 24 MB (medians of 5, load average about 23 on
2 cores), so the carry stays. (No other composite, such as reduce + scatter, was measured.)

The input buffer is FSDP2's own temporary (freed after the call), so the in-place all-reduce costs
no memory; only the ``1/N`` output is kept. FSDP2 plugs this in through its custom-comm interface
(``FSDPModule.set_custom_reduce_scatter``), which the compressed reduce-scatter
(``comm/reduce_scatter.py``) also uses: when compression is on, it replaces this one.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch
import torch.distributed as dist

from trainmesh._torch.flat_collectives import reduce_scatter_flat

try:  # FSDP2's custom-comm interface; not exported publicly, hence the private path
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # an older torch: FSDP2 keeps its default reduce-scatter
    ReduceScatter = object  # type: ignore[misc,assignment]


_carrying = threading.local()


def carrying_reduce_scatter() -> bool:
    """True inside :class:`AllReduceScatter`'s all-reduce: an observer that files collectives by kind
    (``planner/collectives.py``) files it as the reduce-scatter it stands for, as a plan does."""
    return getattr(_carrying, "active", False)


class AllReduceScatter(ReduceScatter):
    """``fsdp_module.set_custom_reduce_scatter(AllReduceScatter())``."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ):
        # FSDP2 calls this synchronously (it orders work by streams, which a CPU does not have), so
        # ``async_op`` is honoured by finishing first: the returned ``None`` means "already done".
        rows = dist.get_world_size(group)
        if input_tensor.numel() != rows * output_tensor.numel():
            raise ValueError(
                f"A reduce-scatter over {rows} processes needs an input {rows}x its output; "
                f"received {input_tensor.numel()} and {output_tensor.numel()} elements"
            )
        all_reduce_rows(output_tensor, input_tensor, group, op)
        return None


def all_reduce_rows(output: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> None:
    """This rank's row of ``rows`` (``N`` equal rows, flat) summed over ``group``, into ``output``,
    by an all-reduce of ``rows`` in place (``rows`` is then the reduced whole)."""
    _carrying.active = True
    try:
        dist.all_reduce(rows, op=op, group=group)
    finally:
        _carrying.active = False
    row = output.numel()
    start = dist.get_rank(group) * row
    output.view(-1).copy_(rows.view(-1)[start : start + row])


def reduce_scatter_rows(
    output: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM
) -> None:
    """A reduce-scatter of ``rows`` (may be overwritten) into ``output``, by :func:`all_reduce_rows`
    where gloo carries it, else by the backend's own reduce-scatter."""
    if carries_reduce_scatter_by_all_reduce(group, rows.device):
        all_reduce_rows(output, rows, group, op)
    else:
        reduce_scatter_flat(output, rows, op=op, group=group)


def carries_reduce_scatter_by_all_reduce(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether FSDP2 over ``group`` should use :class:`AllReduceScatter`: its tensors on the CPU
    (so gloo carries them) and the interface present. (The planner's dry run, on torch's "fake"
    group, keeps FSDP2's reduce-scatter: a plan prices it per backend, as gloo's all-reduce on gloo.)"""
    return ReduceScatter is not object and device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def install_all_reduce_scatter(model: torch.nn.Module) -> int:
    """Give every FSDP unit of ``model`` an :class:`AllReduceScatter`; returns how many."""
    from trainmesh._torch.zero import fsdp_units  # (zero.py imports this module)

    units = fsdp_units(model)
    for _, module in units:
        module.set_custom_reduce_scatter(AllReduceScatter())
    return len(units)
