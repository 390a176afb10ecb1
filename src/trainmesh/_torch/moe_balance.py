"""Load balancing over the global batch: the quantities a MoE router is balanced by, summed over every
process of the batch axis (and of a sequence axis beside it) before they are used, so they equal one
process on the whole batch.

``load_balancing_loss`` is transformers' auxiliary loss over the global batch; ``batch_group`` is the
group those sums run over, shared with DeepSeek-V3's bias balancing (``trainer/router_bias.py``).

Beside a sequence axis the Trainer weights each process's loss by its share of the real tokens
(``context_parallel.token_weighted_loss``), which is right for a token mean but not for this loss: its
gradient is already one process's share of the global one, and that weight would scale it again (with
padding the shares differ, and the router's averaged gradient was no longer one process's). So the
Trainer records the values returned here during its forward and loss (``recording_aux_terms``) and
weights the loss's part through them by 1 instead (``aux_part``).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist

from .mesh import to_torch_mesh

__all__ = ["aux_part", "batch_group", "load_balancing_loss", "recording_aux_terms"]

# set by the Trainer around its forward and loss only, so a user's own loop keeps no graph alive here
_recorded: contextvars.ContextVar[list | None] = contextvars.ContextVar("trainmesh_aux_terms", default=None)


@contextlib.contextmanager
def recording_aux_terms():
    """Within it, every ``load_balancing_loss`` value that needs a gradient is appended to the list it yields."""
    terms: list = []
    token = _recorded.set(terms)
    try:
        yield terms
    finally:
        _recorded.reset(token)


def aux_part(loss: torch.Tensor, terms: list) -> torch.Tensor | None:
    """The first-order part of ``loss`` that comes through ``terms``: ``sum_i (dloss/dterm_i) * term_i``
    with the derivatives held constant (for ``lm + c * aux``, ``c * aux``), so that ``w * loss + (1 - w) *
    aux_part`` has the gradient ``w * d lm + c * d aux`` (exact for any loss: only its gradient here
    matters). One small backward from ``loss`` to the terms (the ops of the loss function between them);
    None when no term reaches ``loss``."""
    terms = [t for t in terms if t.requires_grad]
    if not terms or not (torch.is_tensor(loss) and loss.requires_grad and loss.dim() == 0):
        return None
    slopes = torch.autograd.grad(loss, terms, retain_graph=True, allow_unused=True)
    parts = [s.detach() * t for s, t in zip(slopes, terms) if s is not None]
    return sum(parts[1:], parts[0]) if parts else None


def batch_group(distribution):
    """The process group and size of the processes that hold different tokens: the batch axis, times the
    sequence axis where there is one (its processes hold different tokens of the same samples); (None, 1)
    when there is nothing to reduce over."""
    if distribution is None or not (dist.is_available() and dist.is_initialized()):
        return None, 1
    if getattr(distribution, "sequence", None) is not None:  # data x seq, as the gradients are averaged
        from .context_parallel import gradient_group

        group, size = gradient_group(to_torch_mesh(distribution.device_mesh), distribution)
        return (group, size) if size > 1 else (None, 1)
    size = distribution.data_parallel_size
    if size == 1:
        return None, 1
    torch_mesh = to_torch_mesh(distribution.device_mesh)
    group = torch_mesh.get_group(distribution.batch_dim_name) if torch_mesh.ndim > 1 else torch_mesh.get_group()
    return group, size


def load_balancing_loss(
    router_logits, num_experts: int, top_k: int, attention_mask: torch.Tensor | None = None, *, distribution=None
) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss of transformers' MoE models (``load_balancing_loss_func``:
    ``num_experts * sum_e f_e * P_e``, f the fraction of top-k assignments to expert e, P its mean router
    probability) over the **global** batch: the per-expert sums of every process of the batch axis (times
    a sequence axis, whose processes hold other tokens of the same samples) are added (one all-reduce of
    ``2 * num_experts + 1`` numbers) before the product, so the value equals one
    process on the whole batch; transformers computes it per process. The gradient reaches the router
    through this process's own tokens, scaled by the number of those processes, so that the gradient
    averaging over them gives one process's gradient. Called inside the Trainer's forward or loss
    function, its part of the loss keeps the weight 1 beside a sequence axis's token weighting (module
    docstring); with padding, pass the mask of the real tokens (e.g. ``targets != -100``, this process's
    chunk), as ring attention is exact for real tokens only.

    ``router_logits``: the model output's ``router_logits`` (``output_router_logits=True``), a tuple of
    ``(tokens, num_experts)`` tensors. ``distribution``: default the current one (``tm.distribution()``);
    without one, or on one process, this is transformers' own value.

    >>> loss = lm_loss(out, y) + config.router_aux_loss_coef * load_balancing_loss(   # doctest: +SKIP
    ...     out.router_logits, config.num_experts, config.num_experts_per_tok)
    """
    if not isinstance(router_logits, (tuple, list)) or not router_logits:
        raise ValueError(
            "load_balancing_loss needs the model output's router_logits (a tuple of per-layer "
            f"(tokens, num_experts) tensors; pass output_router_logits=True). Received: {type(router_logits)}"
        )
    if distribution is None:
        from trainmesh.distribution.distribution import distribution as current

        distribution = current()
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    if mask is not None and mask.numel() != router_logits[0].shape[0]:
        # beside a sequence axis the router saw this process's chunk of each sequence, not the whole mask
        raise ValueError(
            f"load_balancing_loss's attention_mask must cover the tokens the router saw ({router_logits[0].shape[0]} "
            f"rows: over a sequence axis, this process's chunk of each sequence, split like the inputs). "
            f"Received: attention_mask of shape {tuple(attention_mask.shape)}"
        )
    for logits in router_logits:
        weights = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        each = torch.ones_like(chosen, dtype=torch.float32) if mask is None else mask.repeat_interleave(top_k)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen, each)
        probs = probs + (weights if mask is None else weights * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + (weights.shape[0] if mask is None else mask.sum())
    group, size = batch_group(distribution)
    if group is not None:
        local = torch.cat([counts, probs.detach(), rows.reshape(1)])
        total = local.clone()
        dist.all_reduce(total, group=group)
        counts, rows = total[:num_experts], total[-1]
        others = total[num_experts : 2 * num_experts] - local[num_experts : 2 * num_experts]
        # value: the global sum; gradient: this process's share times the group's size (see docstring)
        probs = size * probs - (size - 1) * probs.detach() + others
    value = num_experts * torch.sum((counts / rows) * (probs / rows))
    recorded = _recorded.get()
    if recorded is not None and value.requires_grad:
        recorded.append(value)  # weighted by 1 by the Trainer, beside a token-weighted loss (module docstring)
    return value
