"""``compute_average_loss``: scale a per-example loss by the *global* batch size (TF semantics).

Why the global batch size: each replica computes ``sum(loss of its examples) / global_batch``;
the optimizer step on mirrored parameters then SUMs the replicas' gradients, which gives the
gradient of the mean loss over the whole global batch, exactly what one device would compute,
even when replicas hold different numbers of examples (uneven or partial batches).
"""

from __future__ import annotations

import operator
from typing import Any

import torch


def _num_replicas_in_sync() -> int:
    # Inside strategy.scope() or strategy.run() the strategy's DataParallel is the current
    # distribution; outside any, one replica (TF's default strategy).
    from trainmesh.distribution import distribution

    current = distribution()
    return current.data_parallel_size if current is not None else 1


def compute_average_loss(
    per_example_loss: torch.Tensor, global_batch_size: int | None = None, sample_weight: Any = None
) -> torch.Tensor:
    """``sum(per_example_loss * sample_weight) / global_batch_size`` (TF ``tf.nn.compute_average_loss``).

    ``global_batch_size`` defaults to ``per_example_loss.shape[0] * num_replicas_in_sync`` (the
    replicas of the strategy in scope, 1 outside any), which is right only when every replica
    has the same number of examples: pass it explicitly for uneven or partial batches. A
    global batch size of 0 gives a loss of 0.

    >>> compute_average_loss(torch.tensor([1.0, 2.0, 3.0, 6.0]), global_batch_size=8)
    tensor(1.5000)
    >>> compute_average_loss(torch.tensor([1.0, 3.0]))   # one replica: the plain mean
    tensor(2.)
    """
    if not isinstance(per_example_loss, torch.Tensor):
        raise ValueError(f"per_example_loss must be a tensor. Received: per_example_loss={per_example_loss!r}")
    if per_example_loss.dim() == 0:
        raise ValueError(
            "per_example_loss must have a batch dim (one loss per example; use reduction='none'). "
            f"Received: per_example_loss of shape {tuple(per_example_loss.shape)}"
        )
    if not (per_example_loss.is_floating_point() or per_example_loss.is_complex()):
        per_example_loss = per_example_loss.to(torch.get_default_dtype())
    if sample_weight is not None:
        per_example_loss = per_example_loss * torch.as_tensor(sample_weight, device=per_example_loss.device)
    original = global_batch_size
    if global_batch_size is None:
        global_batch_size = per_example_loss.shape[0] * _num_replicas_in_sync()
    else:
        try:
            # operator.index accepts ints, numpy ints and 0-d integer tensors, and refuses 64.0
            global_batch_size = -1 if isinstance(global_batch_size, bool) else operator.index(global_batch_size)
        except TypeError:
            global_batch_size = -1
        if global_batch_size < 0:
            raise ValueError(f"global_batch_size must be an int >= 0. Received: global_batch_size={original!r}")
    total = per_example_loss.sum()
    if global_batch_size == 0:
        return total * 0.0  # TF: "If global_batch_size is zero, the result is zero"; keeps the graph
    return total / global_batch_size
