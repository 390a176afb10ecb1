"""``chunked_cross_entropy`` (and ``lm_cross_entropy``, whose whole-logits path it is) against
``F.cross_entropy``: the mean over valid tokens and its gradient, in fp32 and from bf16 logits, with ignored
tokens, any block size; and the memory it exists for: no fp32 copy of the whole logits at backward.

Tolerances: fp32, the loss and gradients to 2e-6 relative (summation order: the two sum the same terms in
another order); bf16 logits, the loss against ``F.cross_entropy(logits.float())`` to 2e-6 relative (both in
fp32 from the same bf16 values) and the bf16 gradient within one bf16 rounding (2^-8 relative) of that path's
fp32 gradient cast to bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainmesh.chunked_cross_entropy import chunked_cross_entropy
from trainmesh.losses import lm_cross_entropy
from trainmesh.testing.memory import LiveTensorBytes

pytestmark = pytest.mark.timeout(120)


def _case(rows: int, vocab: int, dtype=torch.float32, seed: int = 0, ignored=(3, 7)):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    for row in ignored:
        if row < rows:
            targets[row] = -100
    return logits, targets


def _loss_and_grad(fn, logits, targets):
    logits.grad = None
    loss = fn(logits, targets)
    loss.backward()
    return loss.detach(), logits.grad.clone()


def _torch_upcast(logits, targets):  # the path lm_cross_entropy had: the whole logits in fp32
    return F.cross_entropy(logits.float(), targets)


@pytest.mark.parametrize("chunk_bytes", [4 * 100, 4 * 100 * 5, 1 << 20])  # one row, 5 rows (uneven), one block
@pytest.mark.parametrize("rows,vocab", [(37, 100), (1, 100), (64, 257)])
def test_fp32_matches_torch_loss_and_gradient(rows, vocab, chunk_bytes):
    logits, targets = _case(rows, vocab)
    loss, grad = _loss_and_grad(lambda x, t: chunked_cross_entropy(x, t, chunk_bytes=chunk_bytes), logits, targets)
    ref_loss, ref_grad = _loss_and_grad(F.cross_entropy, logits, targets)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=2e-6, atol=1e-9)
    assert (grad[targets == -100] == 0).all()  # ignored rows get no gradient


def test_scaled_upstream_gradient_and_other_ignore_index():
    logits, targets = _case(20, 50, ignored=())
    targets[[0, 5]] = 7  # class 7 is the ignored one here
    loss = chunked_cross_entropy(logits, targets, ignore_index=7, chunk_bytes=4 * 50 * 3)
    (loss * 2.5).backward()
    grad, logits.grad = logits.grad.clone(), None
    ref = F.cross_entropy(logits, targets, ignore_index=7)
    (ref * 2.5).backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=2e-6, atol=0)
    torch.testing.assert_close(grad, logits.grad, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("chunk_bytes", [4 * 1000 * 3, 1 << 20])
def test_bf16_logits_close_to_the_fp32_upcast(chunk_bytes):
    logits, targets = _case(48, 1000, dtype=torch.bfloat16)
    loss, grad = _loss_and_grad(lambda x, t: chunked_cross_entropy(x, t, chunk_bytes=chunk_bytes), logits, targets)
    ref_loss, ref_grad = _loss_and_grad(_torch_upcast, logits, targets)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16  # the gradient in the logits' dtype
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=0)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2**-8, atol=1e-12)


def test_no_valid_token_gives_nan_loss_and_zero_gradient_as_torch():
    logits, _ = _case(6, 10)
    targets = torch.full((6,), -100)
    loss, grad = _loss_and_grad(chunked_cross_entropy, logits, targets)
    ref_loss, ref_grad = _loss_and_grad(F.cross_entropy, logits, targets)
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    assert torch.equal(grad, ref_grad) and not grad.any()


def test_bad_shapes_and_targets_raise():
    logits, targets = _case(4, 10)
    with pytest.raises(ValueError, match="rows"):
        chunked_cross_entropy(logits.unsqueeze(0), targets)
    with pytest.raises(RuntimeError):  # out of range, as F.cross_entropy refuses it
        chunked_cross_entropy(logits, torch.tensor([0, 1, 2, 10]))


def test_lm_cross_entropy_on_outputs_under_autocast():
    class Out:  # a transformers output: the loss reads .logits
        def __init__(self, logits):
            self.logits = logits

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 16, generator=g)
    head = torch.randn(40, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (2, 9), generator=g)
    targets[0, :3] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = hidden @ head.t()  # bf16 under autocast, as a model's head
        loss = lm_cross_entropy(Out(logits), targets)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    grad, head.grad = head.grad.clone(), None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((hidden @ head.t()).float().reshape(-1, 40), targets.reshape(-1))
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=2e-6, atol=0)
    # the head's gradient is a bf16 matmul of the two paths' bf16 logits gradients (within one rounding)
    torch.testing.assert_close(grad, head.grad, rtol=2e-2, atol=1e-4)


def test_no_whole_fp32_copy_of_bf16_logits():
    """The upcast path holds 3 fp32 buffers of the logits' size at its backward (6x the bf16 logits); this one
    the bf16 logits, their bf16 gradient, and one fp32 block's temporaries."""
    rows, vocab, chunk = 256, 8192, 1 << 18
    logits, targets = _case(rows, vocab, dtype=torch.bfloat16)
    size = logits.numel() * logits.element_size()  # 4 MiB
    peaks = {}
    for name, fn in {
        "chunked": lambda x, t: chunked_cross_entropy(x, t, chunk_bytes=chunk),
        "upcast": _torch_upcast,
    }.items():
        with LiveTensorBytes("cpu") as memory:
            # made inside: a storage the tracker first meets through a view would count as new
            x = logits.detach().clone().requires_grad_()
            base = memory.live
            fn(x, targets).backward()
            peaks[name] = memory.peak - base
    # the gradient (size) and per-block temporaries: the fp32 block, its exp, a few row vectors
    assert peaks["chunked"] <= size + 3 * chunk + 64 * rows, peaks
    assert peaks["upcast"] >= 5 * size, peaks  # what the chunks avoid, still true of the upcast path


def test_lm_cross_entropy_chunks_large_logits_only():
    """Small logits take ``F.cross_entropy`` on the fp32 upcast (bit for bit the old path: the chunks' fixed
    cost is not paid back there); from ``CHUNKED_FROM_BYTES`` (counted in fp32) the chunked loss."""
    from trainmesh.losses import CHUNKED_FROM_BYTES

    small, targets = _case(8, 64, dtype=torch.bfloat16)
    loss = lm_cross_entropy(small.unsqueeze(0), targets.unsqueeze(0))
    assert torch.equal(loss, F.cross_entropy(small.float(), targets))
    vocab = 4096
    rows = CHUNKED_FROM_BYTES // (4 * vocab)
    large, targets = _case(rows, vocab, dtype=torch.bfloat16)
    loss = lm_cross_entropy(large.unsqueeze(0), targets.unsqueeze(0))
    assert type(loss.grad_fn).__name__ == "_ChunkedCrossEntropyBackward"
    torch.testing.assert_close(loss, F.cross_entropy(large.float(), targets), rtol=2e-6, atol=0)
