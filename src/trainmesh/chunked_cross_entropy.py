"""Next-token cross-entropy that never holds an fp32 copy of the whole logits.

``F.cross_entropy(logits.float(), targets)`` on bf16 logits (what a bf16-mixed step hands the loss) keeps,
at its backward, three fp32 buffers the size of the logits: the upcast copy, the log-softmax it saves, and
the gradient of that log-softmax, before the gradient is cast back to bf16. With a vocabulary of 16k and
128 tokens that is 3 x 8 MiB per sequence: at a mostly frozen model's loss (LoRA under ZeRO-3) the largest
part of the step's peak.

``chunked_cross_entropy`` computes the same mean in fp32 one block of rows at a time:

* forward saves only the logits autograd already had (in their own dtype) and one fp32 logsumexp per row;
* backward writes the gradient ``(softmax(row) - onehot(target)) * grad / valid_tokens`` block by block,
  straight into a buffer of the logits' dtype.

So the fp32 working set is one block (``CHUNK_BYTES``), whatever the batch. In fp32 the values are those of
``F.cross_entropy`` up to summation order (a few ulp); in bf16 the gradient is the same fp32 value rounded to
bf16 once, as the upcast path's cast-back does (within one bf16 ulp of it).

    >>> import torch
    >>> logits = torch.zeros(3, 5, requires_grad=True)
    >>> loss = chunked_cross_entropy(logits, torch.tensor([1, 2, -100]))
    >>> round(loss.item(), 4)  # log(5)
    1.6094
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["chunked_cross_entropy", "CHUNK_BYTES"]

IGNORE_INDEX = -100
# fp32 bytes of one block's working set: small beside the logits (8 MiB for 128 x 16k), large enough that the
# per-block Python cost (a few microseconds) is noise against its exp over 256k elements
CHUNK_BYTES = 1 << 20


def _rows_per_chunk(vocab: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (4 * max(vocab, 1)))


def _no_autocast(device: torch.device):
    # the blocks are upcast by hand; autocast must not cast them back down (it may run inside a forward context)
    return torch.autocast(device_type=device.type, enabled=False)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, chunk_bytes: int):
        rows, vocab = logits.shape
        step = _rows_per_chunk(vocab, chunk_bytes)
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0).unsqueeze(1)  # ignored rows point at column 0; their weight is 0
        picked = torch.empty(rows, 1, dtype=torch.float32, device=logits.device)
        with _no_autocast(logits.device):
            for start in range(0, rows, step):
                # torch's fused log-softmax, upcasting as it reads (no separate fp32 copy of the block)
                block = torch.log_softmax(logits[start : start + step], dim=1, dtype=torch.float32)
                torch.gather(block, 1, safe[start : start + step], out=picked[start : start + step])
            count = valid.sum()  # 0 valid tokens: 0 / 0 = nan, as F.cross_entropy's mean
            loss = -(picked.squeeze(1) * valid).sum() / count
        ctx.save_for_backward(logits, safe, valid, count)
        ctx.step = step
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        logits, safe, valid, count = ctx.saved_tensors
        step = ctx.step
        with _no_autocast(logits.device):
            # d loss / d row's loss; ignored rows 0 (no valid token at all: a zero gradient, as F.cross_entropy's)
            weight = torch.where(valid, grad_loss.float() / count, torch.zeros((), device=logits.device))
            weight = weight.unsqueeze(1)
            grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
            for start in range(0, logits.shape[0], step):
                end = min(start + step, logits.shape[0])
                block = torch.softmax(logits[start:end], dim=1, dtype=torch.float32)  # recomputed, fp32
                block.scatter_add_(1, safe[start:end], _minus_one(block, end - start))  # softmax - onehot
                # scaled and rounded to the logits' dtype in one pass, straight into the gradient
                torch.mul(block, weight[start:end], out=grad[start:end])
        return grad, None, None, None


def _minus_one(block: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.full((rows, 1), -1.0, dtype=block.dtype, device=block.device)


def chunked_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX, chunk_bytes: int = CHUNK_BYTES
) -> torch.Tensor:
    """Mean cross-entropy (fp32 scalar) of ``logits`` (rows x classes, any float dtype) against ``targets``
    (rows of class ids; ``ignore_index`` rows count in neither the sum nor the mean). The gradient has the
    logits' dtype. Not twice differentiable."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"chunked_cross_entropy takes logits (rows, classes) and targets (rows,); got {tuple(logits.shape)} "
            f"and {tuple(targets.shape)}"
        )
    return _ChunkedCrossEntropy.apply(logits, targets.to(logits.device), ignore_index, chunk_bytes)
