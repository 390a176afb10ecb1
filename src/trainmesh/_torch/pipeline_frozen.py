"""A pipeline over a model with frozen parameters: a peft LoRA model on a fine-tuned base.

What peft's wrapping looks like to the split, and why it needs no more than this module:
``peft.get_peft_model`` moves the model under ``base_model.model.`` and replaces each target
Linear / Conv1D by a LoRA layer holding it as ``base_layer`` beside ``lora_A`` / ``lora_B``.
Stages are pruned copies of the whole model (``pipeline_split``), so the peft model's own
``forward`` runs on each of them unchanged; the block container is found wherever it sits
(``base_model.model.model.layers`` for Llama, ``base_model.model.transformer.h`` for GPT-2), the
LoRA layers are inside the blocks, and every tensor keeps its global name, which is what the
optimizer, layouts and ``save_pretrained``'s peft naming all key on. Two things did differ:

* a weight tied across the first and last stage (GPT-2's ``wte`` and ``lm_head``) gets its two
  copies' gradients summed after each step, and that sum used to zero-fill a missing gradient
  first. A frozen tied weight then got a gradient and an all-reduce every step; under a model
  axis gloo aborted the job (the zero-filled gradient had the embedding's vocabulary-sharded
  shape on one stage and the head's whole shape on the other). A frozen weight has nothing to
  sum: ``trainable_tied`` drops it before any group is made. ``requires_grad`` is the same on
  every process, so every process makes the same groups.
* split points name blocks; a user who writes them as for the base model (``model.layers.2``)
  means the block under peft's prefix (``split_points_for``).

Everything else that keeps frozen parameters free already keys on their gradient being None:
the data-axis all-reduce after the schedule takes parameters that have a gradient, FSDP2
reduce-scatters those only, and the Trainer builds the optimizer over trainable parameters.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ..distribution.adapters import PEFT_PREFIX


def trainable_tied(model: nn.Module, tied: list[list[str]]) -> list[list[str]]:
    """The groups of tied names (``pipeline_apply._tied_names``) whose weight trains."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [names for names in tied if params[names[0]].requires_grad]


def split_points_for(model: nn.Module, points: str | Sequence[str]) -> str | Sequence[str]:
    """``points`` with each one the base model would name (``model.layers.2``) spelt as the peft model
    does (``base_model.model.model.layers.2``); others, and ``"auto"``, unchanged."""
    if isinstance(points, str) or not any(path.startswith(PEFT_PREFIX) for path, _ in model.named_modules()):
        return points
    paths = {path for path, _ in model.named_modules()}
    return [PEFT_PREFIX + point if point not in paths and PEFT_PREFIX + point in paths else point for point in points]
