"""Loss functions the Trainer knows how to compute on a model's shards.

``lm_cross_entropy(outputs, targets)`` is the usual next-token loss (targets already shifted, -100
ignored, the mean over the other tokens). Handed to ``tm.Trainer`` as its ``loss_fn`` under tensor
parallelism, it lets the column-wise head keep its vocabulary shard for the training step and computes
the cross-entropy on the shards (``_torch/vocab_parallel.py``), so no process holds or saves whole
logits. Over a sequence axis, ``evaluate`` with no metrics computes it on each process's chunks of the
sequence (``_torch/context_parallel_eval.py``). Anywhere else (one process, data parallelism,
``predict``, a call by hand) it is the same mean over the whole logits in fp32: from ``CHUNKED_FROM_BYTES``
of logits (counted in fp32) a block of rows at a time (``chunked_cross_entropy.py``: bf16 logits are never
copied whole to fp32, the gradient is written in their dtype), below it ``F.cross_entropy(logits.float())``.
The script is the same for every layout.

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

from trainmesh.chunked_cross_entropy import chunked_cross_entropy

__all__ = ["lm_cross_entropy", "CHUNKED_FROM_BYTES"]

# Where the chunked loss is not slower (CPU time of forward + backward, one thread, interleaved with the upcast
# path): 128 x 16384 logits (8 MiB in fp32) took 0.90-0.98x in bf16 and 0.67-1.2x in fp32 (noise at load
# 8-12), 512 x 32000 0.3-0.5x; 64 x 16384 bf16 (4 MiB) 1.15x and 128 x 2048 ~2x: a fixed ~0.4 ms of Python
# and small ops per call, which the memory saved (3 fp32 copies of a small logits) does not pay for.
CHUNKED_FROM_BYTES = 6 << 20


def lm_cross_entropy(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``outputs`` (a tensor of logits, or a transformers output with ``.logits``)
    against ``targets`` (class ids, -100 ignored), in fp32; the logits' gradient has their dtype."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    if hasattr(logits, "placements"):  # the head's vocabulary shard (keep_vocab_shards)
        from trainmesh._torch.vocab_parallel import sharded_cross_entropy

        return sharded_cross_entropy(logits, targets)
    flat, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device)
    if flat.numel() * 4 >= CHUNKED_FROM_BYTES:
        return chunked_cross_entropy(flat, targets)
    return F.cross_entropy(flat.float(), targets)


lm_cross_entropy.vocab_parallel = True  # the Trainer's step keeps the head's shards for this loss
# a mean over tokens: over a sequence axis ``evaluate`` sums it over each process's chunk, no whole logits
lm_cross_entropy.token_mean = True
