"""Collectives over many tensors at once, through a few large flat buffers (as DDP's buckets).

Many small collectives cost one network latency each; concatenating tensors of the same
device and dtype into buffers of up to ``cap_bytes`` costs one per buffer. Only
torch.distributed collectives are used (broadcast, all_reduce), never a hand-written one.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist


def buckets(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Group tensors by (device, dtype), in order, into runs of at most ``cap_bytes`` each.

    The grouping depends only on parameters' metadata, identical on every replica, so every
    replica issues the same collectives in the same order.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for group in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for tensor in group:
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > cap_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(tensor)
            size += nbytes
        if bucket:
            yield bucket


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], src: int, cap_bytes: int) -> None:
    """Overwrite ``tensors`` on every process with process ``src``'s values (flat buffers)."""
    for bucket in buckets(tensors, cap_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, src=src)
        if dist.get_rank() != src:
            for tensor, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                tensor.copy_(part.view_as(tensor))


@torch.no_grad()
def all_reduce_gradients(params: list[torch.Tensor], cap_bytes: int) -> None:
    """SUM every parameter's ``.grad`` over all processes, in place; ``None`` counts as zeros."""
    for param in params:
        if param.grad is not None and param.grad.layout != torch.strided:
            raise ValueError(f"Mirrored parameters need dense gradients. Received: grad layout={param.grad.layout}")
    in_flight = []
    for bucket in buckets(params, cap_bytes):
        sizes = [p.numel() for p in bucket]
        total = sum(sizes)
        flat = torch.zeros(total + len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
        offset = 0
        for i, (param, size) in enumerate(zip(bucket, sizes)):
            if param.grad is not None:
                flat[offset : offset + size].copy_(param.grad.reshape(-1))
                flat[total + i] = 1  # "this replica has a gradient" flag, summed with the rest
            offset += size
        in_flight.append((bucket, sizes, flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)))
    for bucket, sizes, flat, work in in_flight:
        work.wait()
        total = sum(sizes)
        parts = flat[:total].split(sizes)
        flags = flat[total:].tolist()  # one device->host copy per bucket, not one per parameter
        for param, part, flag in zip(bucket, parts, flags):
            if flag == 0:
                continue  # no replica produced a gradient: stays None, the optimizer skips it
            if param.grad is None:
                param.grad = part.view_as(param).clone()
            else:
                param.grad.copy_(part.view_as(param.grad))
