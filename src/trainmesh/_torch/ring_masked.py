"""Ring attention's masked case: left padding and packed documents over a sequence axis.

torch's ring templates (``ring_attention.py``) run the device's kernels with ``is_causal`` alone: each
of their steps attends one query chunk to one K/V chunk and is told nothing of the positions either
holds, so no padding or document mask can reach it. The causal mask is all right padding needs (a real
token never sees a later pad), but padding before real tokens and packed sequences need the whole mask.
For them the K/V are all-gathered over the axis (the templates gather them once per layer as well), and
this process's queries attend to the whole sequence with their rows of the mask through
``F.scaled_dot_product_attention`` (the device's own kernel, which takes a boolean mask). Backward is the
all-gather's own: the K/V gradients reduce-scattered back to their owners. The forward traffic is the
ring's; what is saved for backward is the gathered K/V (S tokens where the ring keeps S / n).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd

from .ring_attention import _kernel_dtype


def _gather_kv(key: torch.Tensor, value: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, s, D]`` each -> ``[B, H, n*s, D]`` each: every process's tokens in process order (the
    gathered order), K and V in one all-gather (as the ring templates gather them)."""
    out = all_gather_tensor_autograd(torch.stack([key, value]), 3, group)
    out = out.wait() if hasattr(out, "wait") else out
    return out[0], out[1]


def masked_ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group,
    positions: torch.Tensor,
    order: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """This process's query chunks ``[B, H, s, D]`` (global ``positions``) over the whole sequence's keys
    (``key``/``value`` ``[B, Hkv, s, D]``, grouped heads allowed). ``order``: the gathered layout's global
    positions; ``mask``: ``[B, 1, S, S]`` boolean (True = attend) in sequence order, causal included.
    Returns ``[B, H, s, D]``."""
    dtype = _kernel_dtype(query, key, value)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    rows = mask.index_select(2, positions).index_select(3, order)  # [B, 1, s, S]: keys in the gathered order
    key, value = _gather_kv(key, value, group)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=rows, scale=scale, enable_gqa=key.shape[1] != query.shape[1]
    )
