"""Ulysses attention (DeepSpeed's): an all-to-all turns a sequence split into a head split and back.

Each process of the sequence axis holds ``s = S / n`` tokens of every head. One all-to-all each for
Q, K and V hands every process ``H / n`` heads of the whole sequence; attention then runs with the
device's own kernel (``F.scaled_dot_product_attention``) over the full sequence, causal mask and
padding mask exactly as on one process; a fourth all-to-all brings the output back to the sequence
split. Backward is the same four all-to-alls, reversed (``all_to_all_single_autograd``).

The chunks arrive in the order of the processes: process 0's head-tail pair, then process 1's, ...
(``SequenceSplit.gathered_order``); they are put in sequence order for the kernel's causal mask and
back afterwards (an index_select each way, on ``H / n`` heads).

Bounded by heads: the query heads must divide over the axis. Grouped K/V heads that do not divide
are repeated to the query heads first (exact, at more traffic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = all_to_all_single_autograd(x, None, None, group)
    return out.wait() if hasattr(out, "wait") else out


def seq_to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """``[B, H, s, D]`` (this process's tokens, every head) -> ``[B, H/n, n*s, D]`` (its heads, every
    process's tokens in process order)."""
    b, h, s, d = x.shape
    x = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # [n: head group, B, H/n, s, D]
    x = _all_to_all(x, group)  # [n: source process (its tokens), B, H/n, s, D]
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_seq(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[B, H/n, n*s, D]`` -> ``[B, H, s, D]``."""
    b, h, length, d = x.shape
    s = length // n
    x = x.reshape(b, h, n, s, d).permute(2, 0, 1, 3, 4).contiguous()  # [n: owner of the tokens, B, H/n, s, D]
    x = _all_to_all(x, group)  # [n: head group, B, H/n, s, D]
    return x.transpose(0, 1).reshape(b, n * h, s, d)


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group,
    n: int,
    order: torch.Tensor,
    restore: torch.Tensor,
    scale: float | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this process's chunks (``[B, H, s, D]`` queries, ``[B, Hkv, s, D]`` keys and
    values) over the whole sequence. ``order``: the gathered layout's global positions; ``restore``: its
    argsort. ``mask``: ``[B, 1, S, S]`` boolean (True = attend) in sequence order, or ``None`` (causal).
    Returns ``[B, H, s, D]``."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % n:  # this process's heads: fewer than the model's under tensor parallelism
        raise ValueError(
            f"Ulysses splits this process's {heads} attention heads over the sequence axis of {n}; they "
            f"do not divide (tensor parallelism leaves each process heads / model axis). Use "
            f"context_parallel='ring'. Received: {heads} local heads, axis size {n}"
        )
    if kv_heads % n:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (seq_to_heads(t, group, n).index_select(2, restore) for t in (query, key, value))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return heads_to_seq(out.index_select(2, order), group, n)
