"""Trainable-only checkpoints: the model's state without its frozen parameters.

A fine-tune with a frozen base (peft LoRA, or any ``requires_grad=False`` parameter) changes the
trainable parameters only; the base is rebuilt from its own weights at every start, the same way
the first start built it. Saving only what changes makes a LoRA checkpoint a small fraction of the
model. torch's ``get_model_state_dict(..., ignore_frozen_params=True)`` leaves the frozen
parameters out under any wrapper (DDP, FSDP2, tensor parallel, compile), by unwrapped FQN.

Persistent buffers stay in: a frozen module's buffers may still move in training (BatchNorm's
running statistics in train mode), which a bit-identical resume needs, and they are small. (A
transformers Llama or GPT-2 has none: its rotary and mask buffers are not persistent.)

Loading reads into a template of the same keys and sets it with ``strict=False`` (the frozen
parameters are absent on purpose). That would also let a mismatch pass silently: a tensor saved
but frozen now would not load, one trainable now but not saved would keep its fresh values. So
the saved names, recorded in the checkpoint's marker, are compared with the model's first, and
every rank learns every rank's verdict before DCP's own collectives (one rank raising alone would
leave the others waiting in them).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

_NAMED = 8  # names listed in an error; the rest are counted


def model_state(model: nn.Module, *, frozen: bool = True) -> dict[str, Any]:
    """This rank's shards of the model state; without frozen parameters for ``frozen=False``."""
    return get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=not frozen))


def _pipelined(model: nn.Module) -> bool:
    return getattr(model, "_trainmesh_pipeline", None) is not None  # each stage holds its own keys


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def manifest(model: nn.Module, save_frozen: bool, process_group=None) -> dict[str, Any]:
    """What a checkpoint of ``model`` holds, for its marker: ``{"frozen_saved": True}`` when it is
    everything, else the saved keys (trainable parameters, buffers) and the frozen ones left out.
    Collective under a pipeline (the stages' keys are gathered); otherwise local."""
    if save_frozen:
        return {"frozen_saved": True}
    # Under a pipeline one stage may hold no frozen parameter while another does: the stages decide
    # together (a stage deciding alone would skip the gather its peers wait in).
    pipelined = _pipelined(model) and _distributed()
    if not pipelined and all(p.requires_grad for p in model.parameters()):
        return {"frozen_saved": True}
    everything, saved = set(model_state(model)), set(model_state(model, frozen=False))
    if pipelined:
        gathered: list = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, (sorted(everything), sorted(saved)), group=process_group)
        everything = set().union(*(set(e) for e, _ in gathered))
        saved = set().union(*(set(s) for _, s in gathered))
    if everything == saved:
        return {"frozen_saved": True}
    return {"frozen_saved": False, "saved": sorted(saved), "frozen_left_out": sorted(everything - saved)}


def trainable_only_keys(marker: dict[str, Any]) -> list[str] | None:
    """The model keys a checkpoint's marker says it holds, or None for a full checkpoint (also
    every checkpoint written before trainable-only ones existed)."""
    contents = marker.get("model_tensors") or {}
    return None if contents.get("frozen_saved", True) else list(contents.get("saved", []))


def _listed(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return ", ".join(names[:_NAMED]) + more


def check_same_trainable(model: nn.Module, saved: list[str], path: str, process_group=None) -> None:
    """Raise ``ValueError`` on every rank when ``model``'s trainable tensors are not the ones a
    trainable-only checkpoint holds. Collective when distributed (one small all-gather)."""
    local = sorted(model_state(model, frozen=False))
    views = [local]
    if _distributed():
        views = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(views, local, group=process_group)
    # The same verdict on every rank, from every rank's view: under a pipeline the stages together
    # must hold the saved set; otherwise each rank must, by itself.
    sets = [set().union(*map(set, views))] if _pipelined(model) else [set(v) for v in views]
    wanted = set(saved)
    for rank, have in enumerate(sets):
        not_here, not_saved = wanted - have, have - wanted
        if not (not_here or not_saved):
            continue
        where = "" if len(sets) == 1 else f" (rank {rank})"
        problems = []
        if not_here:
            problems.append(f"saved but frozen or absent in this model{where}: {_listed(not_here)}")
        if not_saved:
            problems.append(f"trainable in this model{where} but not in the checkpoint: {_listed(not_saved)}")
        raise ValueError(
            f"{path} holds the trainable tensors of its run only (its frozen parameters were left out, "
            f"ShardedCheckpoint(save_frozen=False)), and this model's trainable set differs; nothing was "
            f"loaded. Tensors {'; '.join(problems)}. Freeze and unfreeze as the saving run did (the same "
            f"peft config), or resume from a checkpoint saved with save_frozen=True.")
