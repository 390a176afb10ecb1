"""FLOPs of the matmuls, convolutions and attention one rank runs, counted at the dispatcher.

``torch.utils.flop_counter`` has the formulas (``flop_registry``); ``FlopCounterMode`` counts an op
on ``DTensor`` arguments at their global shapes (a mode runs before the subclass, and the local op
DTensor then runs is not seen by it), which over-counts tensor-parallel work by the shard count.
``LocalFlops`` applies the same formulas to the local shards, the work this rank's device does. CPU attention
(``_scaled_dot_product_flash_attention_for_cpu``) has no formula there; it is counted as the two
matmuls of attention (4·b·h·s_q·s_k·d forward, twice that backward), the convention MFU figures
use (no discount for the causal mask).

>>> import torch
>>> with LocalFlops() as counter:
...     _ = torch.ones(8, 16) @ torch.ones(16, 4)
>>> counter.total
1024
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry


def _attention_flops(name: str, args) -> int:
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.dim() == 4]
    if len(tensors) < 3:
        return 0
    q, k = tensors[0], tensors[1]
    if "backward" in name:  # (grad_out, q, k, v, ...)
        q, k = tensors[1], tensors[2]
    b, h, s_q, d = q.shape
    forward = 4 * b * h * s_q * k.shape[-2] * d
    return 2 * forward if "backward" in name else forward


def _local(value):
    return getattr(value, "_local_tensor", value)


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one op on the tensors given (local shards: see ``LocalFlops``); 0 for an op without a formula."""
    packet = func._overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if "scaled_dot_product" in func.__name__ and "attention" in func.__name__:
        return _attention_flops(func.__name__, args)
    return 0


class LocalFlops(TorchDispatchMode):
    """Sums FLOPs of ops on local tensors while active; ``total`` is the count."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # A DTensor op runs its local op below every mode (this one included): count it on the local
        # shards' shapes, which is the work this rank's device does.
        local_args, local_kwargs, local_out = tree_map(_local, (args, kwargs, out))
        self.total += op_flops(func, local_args, local_kwargs, local_out)
        return out


def model_flops_per_token(num_parameters: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """The MFU convention (PaLM appendix B; torchtitan): 6N + 12·L·H·T per token, forward+backward."""
    return 6 * num_parameters + 12 * num_layers * hidden * seq_len


__all__ = ["LocalFlops", "op_flops", "model_flops_per_token"]
