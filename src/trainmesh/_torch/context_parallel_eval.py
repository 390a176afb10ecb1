"""``evaluate`` and ``predict`` over a sequence axis: whole sequences in, split like training, whole out.

The Trainer's evaluation and prediction loops hand the model whole sequences (unequal shares of a
batch's rows over the batch axis; the processes of one sequence hold the same rows). Inside
:func:`split_sequences` the model's pre-hook (``context_parallel.py``) keeps this process's head-tail
chunks of every sequence, with their global ``position_ids`` and the whole padding mask, exactly as
in training, so attention's memory and work are split over the axis. A forward hook then all-gathers
every output that has the chunk's length in dim 1 (the logits, a base model's hidden states) over the
axis and puts it back in sequence order: ``predict`` returns the original sequences, and the loss
function and metrics of ``evaluate`` see one process's outputs, so its loss is one process's (the sum
over the global tokens over their count, per batch).

When ``evaluate`` needs only the loss (no metrics) and the loss says it is a mean over tokens
(``loss_fn.token_mean``: ``trainmesh.losses.lm_cross_entropy``), nothing is gathered: inside
:func:`loss_on_chunks` the outputs stay this process's chunks, and :func:`chunk_loss` takes the targets'
same positions, sums the loss over them and all-reduces that sum and the token count over the axis.

What the split does not take runs on the whole sequence, as one process (and as before): a length
that does not divide into ``2 x axis`` chunks, an empty share, a cache (generation), ``labels`` inside
the inputs (the model would shift each chunk on its own), hidden states or attentions asked for,
and what the pre-hook refuses in training. Every process of the axis sees the same rows, so all take
the same branch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

_WHOLE_ONLY = ("past_key_values", "cache", "labels")


@contextmanager
def split_sequences(model):
    """Within it, eval-mode forwards of ``model`` (if it has a sequence axis) run split over the axis."""
    from .sync import unwrap

    context = getattr(unwrap(model), "_trainmesh_sequence", None)
    if context is None:
        yield
        return
    context.split_whole += 1
    try:
        yield
    finally:
        context.split_whole -= 1


@contextmanager
def loss_on_chunks(model, loss_fn, metrics):
    """Within it (``evaluate`` with no metrics and a token-mean loss, ``loss_fn.token_mean``), split eval
    forwards of ``model`` keep their outputs as this process's chunks: :func:`chunk_loss` then computes
    the loss on them, and no process gathers whole logits. Yields the sequence context, or None where
    outputs are gathered as before (no sequence axis, metrics that need the outputs, another loss)."""
    from .sync import unwrap

    context = getattr(unwrap(model), "_trainmesh_sequence", None)
    if context is None or metrics or not getattr(loss_fn, "token_mean", False):
        yield None
        return
    context.keep_chunks += 1
    try:
        yield context
    finally:
        context.keep_chunks -= 1


def chunk_loss(context, loss_fn, outputs, targets: torch.Tensor) -> torch.Tensor:
    """The mean of ``loss_fn`` over a batch's global tokens from this process's chunk of the outputs: the
    sum over its tokens (mean x count) and its token count (targets other than -100), all-reduced over the
    axis. A forward that ran whole (``chunk_of_whole``'s list) gives outputs as long as the targets:
    ``loss_fn`` on them, as one process. Every process of the axis holds the same rows, so all take the
    same branch."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    seq_len = targets.shape[1]
    if logits.shape[1] == seq_len:
        return loss_fn(outputs, targets)
    keep, _, _ = context.layout(seq_len, targets.device)
    mine = targets.index_select(1, keep)
    count = (mine != -100).sum().to(torch.float64)
    mean = loss_fn(outputs, mine).to(torch.float64)
    sums = torch.stack([torch.where(count > 0, mean * count, torch.zeros_like(mean)), count])
    dist.all_reduce(sums, group=context.group)
    return (sums[0] / sums[1]).to(mean.dtype if mean.is_floating_point() else torch.float32)


def chunk_of_whole(context, args: tuple, kwargs: dict, tokens: torch.Tensor) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` with this process's chunk of the tokens in place of the whole sequence, or None
    where the forward must stay whole (the module doc's list)."""
    seq_len = tokens.shape[1]
    if tokens.shape[0] == 0 or seq_len % context.split.num_chunks:
        return None
    if any(kwargs.get(name) is not None for name in _WHOLE_ONLY):
        return None
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return None
    keep, _, _ = context.layout(seq_len, tokens.device)
    args, kwargs = list(args), dict(kwargs)  # the caller's kwargs stay as they were (a fallback reuses them)
    chunk = tokens.index_select(1, keep)
    if args:
        args[0] = chunk
    elif kwargs.get("input_ids") is not None:
        kwargs["input_ids"] = chunk
    else:
        kwargs["inputs_embeds"] = chunk
    return tuple(args), kwargs


def gather_hook(module, args, kwargs, output):
    """A forward hook: a split eval forward's outputs back in whole sequences (None otherwise)."""
    call = kwargs.get("trainmesh_sequence")
    if call is None or not call.gather or call.context.keep_chunks:
        return None
    local = call.seq_len // call.context.split.axis_size
    if isinstance(output, dict):  # transformers' ModelOutput (setting a key sets its attribute too)
        for key in list(output.keys()):
            output[key] = _gather(output[key], call, local)
        return output
    if isinstance(output, tuple):
        return type(output)(_gather(value, call, local) for value in output)
    return _gather(output, call, local)


def _gather(value: Any, call, local: int) -> Any:
    if hasattr(value, "full_tensor"):  # a DTensor output of a tensor-parallel model: its whole value first
        value = value.full_tensor()
    if not torch.is_tensor(value) or value.dim() < 2 or value.shape[1] != local:
        return value
    context = call.context
    value = value.contiguous()
    parts = [torch.empty_like(value) for _ in range(context.split.axis_size)]
    dist.all_gather(parts, value, group=context.group)  # group rank = place on the axis (gathered_order's)
    _, _, restore = context.layout(call.seq_len, value.device)
    return torch.cat(parts, 1).index_select(1, restore)
