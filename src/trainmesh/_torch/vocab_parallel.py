"""Cross-entropy on vocabulary shards (Megatron's vocab-parallel loss): no process holds whole logits.

Under tensor parallelism the head (``lm_head``) is column-wise: each process of the model axis computes
the logits of its slice of the vocabulary, and plain TP all-gathers them so that the loss function sees
whole ``(batch, seq, vocab)`` logits. The loss then saves its log-softmax, the whole logits again, for
backward: at a small hidden size and a large vocabulary that is most of what a process saves, and it is
the same on every process of the axis whatever sequence parallelism splits.

When the Trainer's loss function is ``trainmesh.losses.lm_cross_entropy`` the head keeps its shard
(a ``Shard(-1)`` DTensor, for that forward only) and the loss is computed on the shards:

* the row maximum: a local max, all-reduced (MAX) over the model axis;
* the sum of exponentials and the target's logit (on the process owning that vocabulary row, 0
  elsewhere): one SUM all-reduce of both;
* backward: ``softmax - one_hot(target)`` on the local shard, no communication (the head's own
  backward sums its input's gradient over the axis, as it does under plain TP).

What it saves is this process's softmax shard: 1/TP of the whole log-softmax. Anything else
(``predict``, ``evaluate``, a user's own loss, a forward outside the Trainer) gets the whole logits as
before: the switch is :func:`keep_vocab_shards`, entered only by the Trainer's step for a loss that
says ``vocab_parallel = True``. torch's ``loss_parallel`` does the same maths, but by rerouting
DTensor's ops for the whole context, backward included (a process-wide switch; DESIGN.md: none).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

IGNORE_INDEX = -100


class VocabShards:
    """On a tensor-parallel model whose head is column-wise: whether its output stays sharded now."""

    def __init__(self, path: str):
        self.path, self.active = path, 0

    def __call__(self) -> bool:
        return self.active > 0


def head_path(model: nn.Module, plans: dict) -> str | None:
    """The planned, gathered column-wise head (a transformers model's output embeddings), if any."""
    holders = [model] + [m for m in model.modules() if m is not model]
    for holder in holders:
        get = getattr(holder, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if head is None:
            continue
        for path, plan in plans.items():
            if model.get_submodule(path) is head and plan.style == "colwise" and plan.gather_output:
                return path if isinstance(head, nn.Linear) else None
        return None
    return None


@contextmanager
def keep_vocab_shards(model: nn.Module, loss_fn: Any):
    """Within it, ``model``'s head returns its vocabulary shard, if ``loss_fn`` computes on shards."""
    from .sync import unwrap

    shards = getattr(unwrap(model), "_trainmesh_vocab_shards", None)
    if shards is None or not getattr(loss_fn, "vocab_parallel", False):
        yield False
        return
    shards.active += 1
    try:
        yield True
    finally:
        shards.active -= 1


def whole_outputs(value: Any) -> Any:
    """``value`` with every DTensor in it made whole and plain (for metrics after a sharded-loss step)."""
    if hasattr(value, "full_tensor"):
        return value.detach().full_tensor()
    if isinstance(value, dict):  # transformers' ModelOutput too (setting a key sets its attribute)
        for key in list(value.keys()):
            value[key] = whole_outputs(value[key])
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(whole_outputs(v) for v in value)
    return value


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-token loss ``logsumexp(logits) - logits[target]`` from each process's vocabulary columns;
    rows whose target is ``IGNORE_INDEX`` give 0 and no gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, targets: torch.Tensor, start: int, group) -> torch.Tensor:
        local = local.float()
        row_max = local.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = local - row_max.unsqueeze(-1)  # a new tensor: ``local`` (the head's output) stays as it was
        owned = (targets >= start) & (targets < start + local.shape[-1])
        index = torch.where(owned, targets - start, torch.zeros_like(targets))
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * owned
        exp = shifted.exp_()  # in place: the one (tokens, vocab / TP) buffer, kept as the softmax
        sums = torch.stack([exp.sum(dim=-1), picked])
        dist.all_reduce(sums, group=group)  # the sum of exponentials and the target's logit, in one call
        sum_exp, target_logit = sums[0], sums[1]
        exp.div_(sum_exp.unsqueeze(-1))
        valid = targets != IGNORE_INDEX
        ctx.save_for_backward(exp, index, owned & valid, valid)
        return (sum_exp.log() - target_logit) * valid

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, owned, valid = ctx.saved_tensors
        grad_local = softmax * (grad * valid).unsqueeze(-1)
        grad_local.scatter_add_(-1, index.unsqueeze(-1), -(grad * owned).unsqueeze(-1).to(grad_local.dtype))
        return grad_local, None, None, None


def sharded_cross_entropy(logits, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose target is not ``IGNORE_INDEX``, from ``logits``: a
    DTensor sharded over its last (vocabulary) dim on a 1-D mesh. Equals ``F.cross_entropy`` on the
    whole logits (``reduction="mean"``)."""
    from torch.distributed.tensor import Shard

    mesh = logits.device_mesh
    if mesh.ndim != 1 or tuple(logits.placements) != (Shard(logits.dim() - 1),):
        raise ValueError(
            "sharded_cross_entropy takes logits sharded over their last dim on a 1-D mesh. "
            f"Received: placements={tuple(logits.placements)} on a {mesh.ndim}-D mesh"
        )
    vocab, size = logits.shape[-1], mesh.size()
    chunk = -(-vocab // size)  # torch's Shard: torch.chunk's sizes, the last ones possibly shorter
    start = min(mesh.get_local_rank() * chunk, vocab)
    local = logits.to_local()  # differentiable: the gradient goes back as the same Shard(-1) DTensor
    flat_targets = targets.reshape(-1).to(local.device)
    per_token = _ShardedCrossEntropy.apply(local.reshape(-1, local.shape[-1]), flat_targets, start, mesh.get_group())
    count = (flat_targets != IGNORE_INDEX).sum()
    return per_token.sum() / count  # 0 / 0 = nan with no valid token, as F.cross_entropy
