"""Loss functions the Trainer knows how to compute on a model's shards.

``lm_cross_entropy(outputs, targets)`` is the usual next-token loss (targets already shifted, -100
ignored, the mean over the other tokens). Handed to ``tm.Trainer`` as its ``loss_fn`` under tensor
parallelism, it lets the column-wise head keep its vocabulary shard for the training step and computes
the cross-entropy on the shards (``_torch/vocab_parallel.py``), so no process holds or saves whole
logits. Over a sequence axis, ``evaluate`` with no metrics computes it on each process's chunks of the
sequence (``_torch/context_parallel_eval.py``). Anywhere else (one process, data parallelism,
``predict``, a call by hand) it is ``F.cross_entropy`` on the whole logits: the script is the same for
every layout.

    >>> import torch
    >>> from trainmesh.losses import lm_cross_entropy
    >>> logits = torch.zeros(1, 3, 5)
    >>> round(lm_cross_entropy(logits, torch.tensor([[1, 2, -100]])).item(), 4)  # log(5)
    1.6094
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["lm_cross_entropy"]


def lm_cross_entropy(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``outputs`` (a tensor of logits, or a transformers output with ``.logits``)
    against ``targets`` (class ids, -100 ignored), in fp32."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    if hasattr(logits, "placements"):  # the head's vocabulary shard (keep_vocab_shards)
        from trainmesh._torch.vocab_parallel import sharded_cross_entropy

        return sharded_cross_entropy(logits, targets)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1).to(logits.device))


lm_cross_entropy.vocab_parallel = True  # the Trainer's step keeps the head's shards for this loss
# a mean over tokens: over a sequence axis ``evaluate`` sums it over each process's chunk, no whole logits
lm_cross_entropy.token_mean = True
