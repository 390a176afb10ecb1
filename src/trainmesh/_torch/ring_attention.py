"""Ring attention over a sequence axis: torch's ring templates, handed the device's own attention kernels.

torch ships the algorithm (``torch.distributed.tensor.experimental._context_parallel``: the K/V
exchange over the axis, the online-softmax merge of the partial results, head-tail load balancing
for causal attention, the backward with its K/V-gradient ring). What it does not ship for the CPU
is a kernel binding: its own ``context_parallel`` dispatches through DTensor, which has no sharding
strategy for ``_scaled_dot_product_flash_attention_for_cpu`` (pytorch issue 147793). So this module
calls the templates directly, as an autograd function, with:

* on CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward;
* on CUDA: ``aten._scaled_dot_product_efficient_attention`` and its backward (the templates' own
  choice for that kernel).

Nothing process-wide changes: no torch function is patched and the templates' module options
(load balance on, K/V all-gathered once per layer, then used chunk by chunk) are read, never set.
Per layer, forward: one all-gather of K/V over the axis; backward: one all-gather of K/V and
``axis - 1`` point-to-point exchanges of the K/V gradients (an all-to-all permutation each), plus
the last one that hands every process its own chunk's gradient back.

Query and K/V chunks are this process's head-tail pair of the sequence, in that order
(``distribution/sequence_split.py``), which is the templates' "round-robin" layout.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.experimental._context_parallel import _attention as cp

aten = torch.ops.aten


def _cpu_forward(query, key, value, *, is_causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)
    return out, lse


def _cpu_backward(*, query, key, value, out, logsumexp, is_causal, grad_out, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale
    )


def _cuda_forward(query, key, value, *, is_causal, scale):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, is_causal, scale=scale
    )
    return out, lse, seed, offset


def _cuda_backward(*, query, key, value, out, logsumexp, is_causal, grad_out, scale, philox_seed, philox_offset):
    return aten._scaled_dot_product_efficient_attention_backward(
        grad_out,
        query,
        key,
        value,
        None,
        out,
        logsumexp,
        philox_seed,
        philox_offset,
        0.0,
        (True, True, True, False),
        is_causal,
        scale=scale,
    )


class _RingAttention(torch.autograd.Function):
    """Grouped K/V heads are repeated for the kernels inside forward and backward only, so what is saved
    for backward is this process's own K/V chunk, with its own number of heads."""

    @staticmethod
    def forward(ctx, query, key, value, group, scale):
        cuda = query.device.type == "cuda"
        repeat = query.shape[1] // key.shape[1]
        results = cp._templated_ring_attention(
            group,
            2,
            _cuda_forward if cuda else _cpu_forward,
            query,
            _repeat(key, repeat),
            _repeat(value, repeat),
            is_causal=True,
            scale=scale,
        )
        out, lse, *rest = results
        ctx.save_for_backward(query, key, value, out, lse, *rest)
        ctx.group, ctx.scale, ctx.cuda, ctx.repeat = group, scale, cuda, repeat
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, *rest = ctx.saved_tensors
        extra = {"philox_seed": rest[0], "philox_offset": rest[1]} if ctx.cuda else {}
        grads = cp._templated_ring_attention_backward(
            ctx.group,
            2,
            _cuda_backward if ctx.cuda else _cpu_backward,
            grad_out.contiguous(),
            "grad_out",
            query,
            _repeat(key, ctx.repeat),
            _repeat(value, ctx.repeat),
            out,
            lse,
            is_causal=True,
            scale=ctx.scale,
            **extra,
        )
        return grads[0], _sum_groups(grads[1], ctx.repeat), _sum_groups(grads[2], ctx.repeat), None, None


def _repeat(kv: torch.Tensor, repeat: int) -> torch.Tensor:
    return kv if repeat == 1 else kv.repeat_interleave(repeat, dim=1).contiguous()


def _sum_groups(grad: torch.Tensor, repeat: int) -> torch.Tensor:
    """The gradient of ``_repeat``: each K/V head's is the sum over the query heads that shared it."""
    if repeat == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.reshape(b, h // repeat, repeat, s, d).sum(2)


def ring_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, group, scale: float | None
) -> torch.Tensor:
    """Causal attention of this process's query chunks ``[B, H, s, D]`` over the whole sequence's keys;
    ``key``/``value`` may carry fewer (grouped) heads. Returns ``[B, H, s, D]``."""
    if not cp._cp_options.enable_load_balance:
        raise ValueError(
            "torch's ring templates were set to no load balancing (_cp_options elsewhere in this "
            "process); trainmesh's chunks are head-tail."
        )
    dtype = _kernel_dtype(query, key, value)
    query, key, value = (t.to(dtype).contiguous() for t in (query, key, value))
    return _RingAttention.apply(query, key, value, group, scale)


def _kernel_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the kernels get, as ``F.scaled_dot_product_attention`` would: autocast's (the kernels are
    called as aten ops, which autocast does not cast), else the promoted one. Under bf16-mixed a Llama's
    rotary embedding leaves Q and K in fp32 and V in bf16, which the kernels refuse mixed."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype
