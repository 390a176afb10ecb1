"""What the zero-bubble schedules' split backward asks of a stage, and what it cannot run.

``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` split each microbatch's backward
in two: an input-gradient pass (``I``, torch's ``stage_backward_input``), sent on at once to the
stage before, and a weight-gradient pass (``W``, ``stage_backward_weight``) run later to fill the
bubble. Three things follow for a stage, found on transformers' GPT-2 and Llama:

* the ``I`` pass detaches each stage output in place, which a view refuses ("Can't detach views
  in-place"). A causal LM's output is one on every stage but the last: it slices the hidden state
  to the positions whose logits it keeps (``hidden_states[:, slice(-logits_to_keep, None)]``) and
  the head that stage does not hold passes it through. That pass-through (``pipeline_split``)
  and the stage (``pipeline_stage``) hand on a copy of a view instead (``not_a_view``), which
  also keeps FSDP2 from warning that the stage model returned one.
* ZeRO-3 frees a stage's gathered parameters after each microbatch's forward. Between one
  microbatch's ``I`` and ``W`` passes the schedule runs other microbatches' forwards, and the
  weight gradients then came out wrong (3e-2 off one process, GPT and Llama alike, on pipe 2 x
  data 2). ``gathered_through_step`` keeps each stage gathered from its first forward to the end of
  the step, as torch's own lowering for FSDP stages does (UNSHARD ... RESHARD around a stage's
  actions), then frees it: ZeRO-3's saving holds between steps, not inside one.
* the ``W`` pass unpacks the saved activations a second time. torch's activation checkpointing
  recomputes a block once per unpacking, and its composable hooks recompute once only (their
  recompute context is a one-shot generator); torch does not support the split with
  ``torch.compile`` either. ``check_split_backward`` refuses both before the first step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv")  # trainmesh's names of torch's schedules that split it


def not_a_view(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy when ``t`` is a view. Not the view's base, though it may hold the same values:
    backward must run through the view, where FSDP2 hooks the pre-backward of the module that
    returned it. The copy is one hidden state per microbatch on the stages that return a view."""
    return t.clone() if t._is_view() else t


@contextlib.contextmanager
def gathered_through_step(stage_models: list[nn.Module]) -> Iterator[None]:
    """For one schedule step: FSDP units that free their parameters after forward (ZeRO-3) keep them
    until the step ends, then free them. Other units (ZeRO 2) and plain stages are left as they are."""
    from torch.distributed.fsdp import FSDPModule

    saved = []
    for model in stage_models:
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            groups = module._get_fsdp_state()._fsdp_param_groups
            if any(group.post_forward_mesh_info is not None for group in groups):
                saved.append((module, [group.post_forward_mesh_info for group in groups]))
                module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module, infos in saved:
            for group, info in zip(module._get_fsdp_state()._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info  # what set_reshard_after_forward(True) would set
            module.reshard()


def check_split_backward(stage_models: list[nn.Module], schedule: str) -> None:
    """Refuse a schedule that splits backward on stages torch cannot run it on (see the module
    docstring); the same on every process, before any step."""
    if schedule not in SPLIT_BACKWARD:
        return
    from torch.distributed._composable import checkpoint as composable_checkpoint

    from .compile import is_compiled_in_place

    checkpointed, compiled = [], []
    for model in stage_models:
        for path, module in model.named_modules():
            if composable_checkpoint.state(module) is not None or getattr(module, "gradient_checkpointing", False):
                checkpointed.append(path or type(module).__name__)
            if is_compiled_in_place(module):
                compiled.append(path or type(module).__name__)
    if checkpointed:
        raise ValueError(
            f"Schedule {schedule!r} splits each backward into an input- and a weight-gradient pass, "
            f"and torch's activation checkpointing cannot recompute a block for both. Checkpointed "
            f"here: {_few(checkpointed)}. Use schedule 'interleaved_1f1b' (or '1f1b') with "
            f"activation checkpointing, or {schedule!r} without it. "
            f"Received: schedule={schedule!r} with activation checkpointing"
        )
    if compiled:
        raise ValueError(
            f"Schedule {schedule!r} splits each backward into an input- and a weight-gradient pass, "
            f"which torch does not support on compiled modules. Compiled here: {_few(compiled)}. "
            f"Use schedule 'interleaved_1f1b' (or '1f1b') with compile, or {schedule!r} with "
            f"compile=False. Received: schedule={schedule!r} with compile"
        )


def _few(paths: list[str], n: int = 3) -> str:
    return ", ".join(paths[:n]) + (f" and {len(paths) - n} more" if len(paths) > n else "")
