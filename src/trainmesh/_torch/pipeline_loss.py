"""The loss of a pipeline microbatch, as the schedule's loss function computes it on the last stage.

torch's schedule calls the loss once a microbatch and averages nothing itself (``scale_grads=False``);
the runner divides by the microbatches (``PipelineRunner._build_schedule``), and here each microbatch's
loss is:

* computed under the precision's autocast, as the Trainer computes a loss without a pipeline;
* weighted by its share of the step's tokens where padding (-100 targets) leaves the microbatches
  unequal counts, so the mean over the microbatches is the token mean over the whole batch
  (``weighted_to_token_mean``, the weighting ``token_weighted_loss`` applies over a sequence axis);
* divided by the Trainer's accumulation steps and scaled by an fp16 loss scaler.
"""

from __future__ import annotations

from typing import Callable

import torch

from .context_parallel import _token_count, weighted_to_token_mean


def real_tokens_if_padded(targets) -> float | None:
    """The targets other than -100 (cross-entropy's ``ignore_index``, counted as ``token_weighted_loss``
    counts them) of a step's integer targets where some are -100, else None (every microbatch then holds
    as many tokens: the plain mean is the mean)."""
    if not torch.is_tensor(targets) or targets.is_floating_point():
        return None
    count = _token_count(targets).item()
    return count if count < targets.numel() else None


def microbatch_weighted(loss: torch.Tensor, targets, total: float | None, parts: int) -> torch.Tensor:
    """A microbatch's mean loss times ``its tokens x parts / the step's tokens``: the schedule's mean over
    the microbatches is then the token mean over the whole batch, as one process computes it on that
    batch, when padding (-100 targets, a left-padding mask) leaves the microbatches unequal counts. A
    pipeline's microbatches are its own cut of the batch, not the user's accumulation steps."""
    if total is None or not torch.is_tensor(targets):
        return loss
    return weighted_to_token_mean(loss, _token_count(targets).item(), total, parts=parts)


def loss_under_precision(precision, loss_fn: Callable, output, target) -> torch.Tensor:
    # Inside autocast, as the Trainer computes a loss without a pipeline (step.py): the schedule calls
    # the loss outside the stage's forward, where cross-entropy on bf16 logits ran in bf16 (a bf16-rounded loss).
    with precision.forward_context():
        return loss_fn(output, target)


def scaled_loss(loss: torch.Tensor, k: int, scaler) -> torch.Tensor:
    if not torch.is_tensor(loss) or loss.dim() != 0:
        raise ValueError(
            f"loss_fn must return a scalar tensor. Received: {type(loss).__name__} "
            f"with shape {tuple(getattr(loss, 'shape', ()))}"
        )
    loss = loss.float() / k
    return scaler.scale(loss) if scaler is not None else loss
