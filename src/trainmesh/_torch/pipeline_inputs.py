"""A pipeline's dict batches: the token ids to the first stage, the side inputs to every stage.

A stage passes one activation tensor to the next, so a padding mask or packed sequences' restarting
``position_ids`` cannot travel with it. They need not: every process holds the batch, and torch's
schedules hand the ``step`` call's keyword arguments to *every* stage's forward, cut into microbatches
like the positional ones (``PipelineStage.forward_one_chunk``). So of an ``{"input_ids", "attention_mask",
"position_ids"}`` batch the runner gives the first stage ``input_ids`` and every stage the other two as
keyword arguments; each stage (``StageModule``) rebuilds the dict, with placeholder ids on a later stage,
and calls the model's own forward with it. That forward builds the causal + padding mask, the packed
sequences' document mask (transformers' ``find_packed_sequence_indices``) and the rotary tables from them
on every stage, exactly as on one process; over a sequence axis its context-parallel pre-hook gets them
as without a pipeline (what that refuses, masks of the wrong shape, is checked up front by
``check_sequence_rules``).

What still cannot work is refused here, by every process alike, before the schedule's first message (a
refusal on the first stage only would leave the others waiting for its shapes): other keys (a custom
input such as ``inputs_embeds``, ``labels``), a mask that is not a ``[batch, seq]`` padding mask (custom
4-D masks), shapes that do not match the tokens, and dict batches for an ``nn.Sequential`` pipeline (its
stages are plain chains of blocks, with nowhere to put a mask).
"""

from __future__ import annotations

from typing import Any

import torch

SIDE_KEYS = ("attention_mask", "position_ids")  # what reaches every stage beside the first's tokens


def split_inputs(inputs: Any, *, sequential: bool, seq_factor: int = 1) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(token ids, side inputs)`` of a batch's inputs; ``seq_factor`` is the sequence axis's size (the
    side inputs stay whole over it while the tokens are this process's chunks)."""
    if torch.is_tensor(inputs):
        return inputs, {}
    if not isinstance(inputs, dict):
        raise ValueError(
            "A pipeline takes a tensor of token ids, or a dict of input_ids with attention_mask and/or "
            f"position_ids. Received: {type(inputs).__name__}"
        )
    keys = sorted(inputs)
    if sequential:
        raise ValueError(
            "An nn.Sequential pipeline runs its stages as plain chains of blocks, which take one tensor: "
            "a padding mask or position_ids has nowhere to go. Pass the token tensor (with -100 targets "
            f"for the positions to ignore), or a transformers model. Received: a dict with keys {keys}"
        )
    extra = [k for k in keys if k != "input_ids" and k not in SIDE_KEYS]
    if "input_ids" not in inputs or extra:
        raise ValueError(
            "A pipeline takes a dict of input_ids with attention_mask and/or position_ids: the first stage "
            "gets the tokens and every stage the mask and positions; other inputs cannot reach the stages "
            f"(the stages pass one activation tensor on). Received: a dict with keys {keys}"
        )
    tokens = inputs["input_ids"]
    if not torch.is_tensor(tokens) or tokens.dim() != 2:
        raise ValueError(
            "A pipeline's input_ids are a [batch, seq] tensor. Received: "
            + (f"input_ids of shape {tuple(tokens.shape)}" if torch.is_tensor(tokens) else type(tokens).__name__)
        )
    rows, seq = tokens.shape[0], tokens.shape[1] * seq_factor
    side = {}
    for key in SIDE_KEYS:
        value = inputs.get(key)
        if value is None:
            continue
        if not torch.is_tensor(value) or value.dim() != 2 or value.shape[1] != seq:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(
                f"Under a pipeline, {key} is a [batch, {seq}] tensor beside input_ids of shape "
                f"{tuple(tokens.shape)}"
                + (" (custom 4-D masks are not supported)" if key == "attention_mask" else "")
                + f". Received: {key} of shape {shape}"
            )
        if value.shape[0] != rows:
            if key != "position_ids" or value.shape[0] != 1:
                raise ValueError(
                    f"Under a pipeline, {key} has a row per input_ids row ({rows}). Received: {key} of "
                    f"shape {tuple(value.shape)}"
                )
            value = value.expand(rows, -1)  # one row for the batch: cut into microbatches like the tokens
        side[key] = value.contiguous()
    return tokens, side


def check_sequence_rules(stage_model, context, tokens: torch.Tensor, side: dict[str, Any]) -> None:
    """Over a sequence axis, what the context-parallel pre-hook refuses (masks or positions of the wrong
    shape), raised here on every process: in a stage's forward
    it would fire on the first stage only, the later ones left waiting for its activations. The pre-hook's
    own preparation, run dry on the whole batch (a small mask scan, no collective)."""
    from .context_parallel import _prepare
    from .context_parallel_checks import transformers_model

    if not side:
        return
    seq = tokens.shape[1] * context.split.axis_size
    _prepare(context, transformers_model(stage_model), (tokens,), dict(side), tokens.shape[0], seq)


def stage_inputs(ids: torch.Tensor, side: dict[str, Any], as_dict: bool) -> Any:
    """What the stage's model is called with: what the user's batch held, the ids alone or a dict."""
    return {"input_ids": ids, **side} if as_dict else ids
