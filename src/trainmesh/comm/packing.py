"""Several compressed tensors as one byte buffer (one collective per bucket instead of one per tensor).

Offsets are 8-byte aligned so that a ``uint8`` slice can be viewed as any dtype on arrival. The
layout (where each tensor lies) depends only on the tensors' shapes and dtypes, so every rank
can unpack every other rank's buffer with its own layout.
"""

from __future__ import annotations

import torch

from trainmesh.compression.base import Compressed

ALIGN = 8


def pack(payloads: list[Compressed]) -> tuple[torch.Tensor, list[tuple[int, str, torch.dtype, torch.Size, int]]]:
    """All tensors of ``payloads`` as one byte buffer, and where each lies in it."""
    layout, raws, offset = [], [], 0
    for index, payload in enumerate(payloads):
        for name, tensor in payload.tensors.items():
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            layout.append((index, name, tensor.dtype, tensor.shape, offset))
            raws.append((offset, raw))
            offset += -(-raw.numel() // ALIGN) * ALIGN
    device = raws[0][1].device if raws else torch.device("cpu")
    buffer = torch.zeros(offset, dtype=torch.uint8, device=device)
    for start, raw in raws:
        buffer[start : start + raw.numel()] = raw
    return buffer, layout


def unpack(buffer: torch.Tensor, layout, payloads: list[Compressed]) -> list[Compressed]:
    """The payloads of ``buffer`` (packed with ``layout``), with the metas of ``payloads``."""
    tensors: list[dict[str, torch.Tensor]] = [{} for _ in payloads]
    for index, name, dtype, shape, start in layout:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        tensors[index][name] = buffer[start : start + size].view(dtype).reshape(shape)
    return [Compressed(t, p.meta) for t, p in zip(tensors, payloads)]
