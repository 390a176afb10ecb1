"""Forward-only passes through a pipeline (``evaluate``, ``predict``): the activations go stage to stage
by plain send/recv, one microbatch, no schedule, since batches there may be uneven or empty.

Each tensor travels as a size, a header (dtype, rank, shape) and its data, so the receiver needs to
know nothing of the shapes in advance.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def forward_only(runner, inputs: Any, *, everywhere: bool) -> torch.Tensor | None:
    """The last stage's output for ``inputs`` through ``runner``'s stages (a ``PipelineRunner``): on
    every pipeline process when ``everywhere``, else on the last stage's only."""
    with _whole_sequences(runner.stage_models):
        return _forward_only(runner, inputs, everywhere=everywhere)


def _forward_only(runner, inputs: Any, *, everywhere: bool) -> torch.Tensor | None:
    tokens, side = runner._split_inputs(inputs, training=False)
    x = None
    last_out = None
    for index in range(runner.num_stages):
        owner = runner.owner_of(index)
        if owner != runner.pipe_rank:
            continue
        module = runner.modules[runner.indices.index(index)]
        if index == 0:
            x = tokens
        else:
            prev = runner.owner_of(index - 1)
            if prev != runner.pipe_rank or x is None:
                x = _recv_tensor(runner.pipe_group, prev, runner.device)
        x = module(x, **side)
        if index == runner.num_stages - 1:
            last_out = x
        else:
            nxt = runner.owner_of(index + 1)
            if nxt != runner.pipe_rank:
                _send_tensor(x, runner.pipe_group, nxt)
    if not everywhere:
        return last_out
    src = runner.owner_of(runner.num_stages - 1)
    if runner.pipe_rank == src:
        for peer in range(runner.pipe_size):
            if peer != src:
                _send_tensor(last_out, runner.pipe_group, peer)
        return last_out
    return _recv_tensor(runner.pipe_group, src, runner.device)


@contextlib.contextmanager
def _whole_sequences(stage_models: list[nn.Module]):
    """Forward-only passes run whole sequences on every process of a sequence axis: the stages pass one
    activation tensor, and a stage's split forward would gather its output back to whole sequences
    (``context_parallel_eval``) that the next stage's split would not take apart again."""
    contexts = [c for c in (getattr(m, "_trainmesh_sequence", None) for m in stage_models) if c is not None]
    saved = [c.split_whole for c in contexts]
    for c in contexts:
        c.split_whole = 0
    try:
        yield
    finally:
        for c, value in zip(contexts, saved):
            c.split_whole = value


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]


def _send_tensor(t: torch.Tensor, group, peer: int) -> None:
    t = t.detach().contiguous()
    header = torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape], dtype=torch.int64)
    size = torch.tensor([header.numel()], dtype=torch.int64)
    dst = dist.get_global_rank(group, peer)
    dist.send(size, dst, group=group)
    dist.send(header, dst, group=group)
    dist.send(t, dst, group=group)


def _recv_tensor(group, peer: int, device) -> torch.Tensor:
    src = dist.get_global_rank(group, peer)
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    header = torch.empty(int(size.item()), dtype=torch.int64)
    dist.recv(header, src, group=group)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    out = torch.empty([int(s) for s in header[2 : 2 + ndim]], dtype=dtype, device=device)
    dist.recv(out, src, group=group)
    return out
