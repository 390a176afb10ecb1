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

Nor would the load notice a base other than the one trained on (another ``weights=`` directory,
another seed): the adapters would load onto it and train on, silently wrong. So the marker also
holds a fingerprint of each frozen tensor, its float64 sum and sum of squares over the whole tensor
(``frozen_fingerprint``), which the load compares before reading anything. It is independent of
the layout: each process sums the region of the tensor it holds, and regions held twice (replicas)
count once.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .shard_ranges import local_region

_NAMED = 8  # names listed in an error; the rest are counted


def model_state(model: nn.Module, *, frozen: bool = True) -> dict[str, Any]:
    """This rank's shards of the model state; without frozen parameters for ``frozen=False``."""
    return get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=not frozen))


def _pipelined(model: nn.Module) -> bool:
    return getattr(model, "_trainmesh_pipeline", None) is not None  # each stage holds its own keys


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def manifest(
    model: nn.Module, save_frozen: bool, process_group=None, fingerprints: dict | None = None
) -> dict[str, Any]:
    """What a checkpoint of ``model`` holds, for its marker: ``{"frozen_saved": True}`` when it is
    everything, else the saved keys (trainable parameters, buffers), the frozen ones left out and
    their fingerprint. Collective under a pipeline (the stages' keys are gathered) and when a
    fingerprint is computed.

    ``fingerprints`` (a saver's own dict) keeps the fingerprint of the last frozen set: a frozen base
    does not train, and a pass over all of it at every save would hold training each time (about 2 ns
    an element here: ~3 s per process for a 7B bf16 base on 4). It also keeps the base as it was when first saved, which is
    what a resume rebuilds, even if it was changed in place since (peft's ``merge_adapter``)."""
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
    left_out = sorted(everything - saved)  # the same on every rank: the same key, the same cache verdict
    fingerprint = (fingerprints or {}).get(tuple(left_out))
    if fingerprint is None:
        fingerprint = frozen_fingerprint(model, process_group)
        if fingerprints is not None:
            fingerprints.clear()
            fingerprints[tuple(left_out)] = fingerprint
    return {
        "frozen_saved": False,
        "saved": sorted(saved),
        "frozen_left_out": left_out,
        "frozen_fingerprint": fingerprint,
    }


# Two sums of the same float32/bf16 values in another order (another layout's regions) agree in
# float64 to about n * 2**-52 of the sum of magnitudes; 1e-9 leaves room and still sees one changed
# element of any size that matters.
_FINGERPRINT_RTOL = 1e-9


def _sums(local: torch.Tensor, chunk: int = 1 << 20) -> tuple[float, float]:
    """Sum and sum of squares in float64, a chunk at a time: never a float64 copy of a whole shard."""
    flat = local.reshape(-1)
    total = squares = 0.0
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk].double()
        total += float(part.sum())
        squares += float(part.square().sum())
    return total, squares


def frozen_fingerprint(model: nn.Module, process_group=None) -> dict[str, list[float]]:
    """Frozen tensor name -> [sum, sum of squares, element count] over the whole tensor, in float64.
    Collective when distributed (one all-gather of a few numbers per tensor)."""
    trainable = set(model_state(model, frozen=False))
    regions = []
    for name, value in model_state(model).items():
        if name in trainable or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        local, offset, shape = local_region(value)
        regions.append((name, offset, shape, *_sums(local.detach()), local.numel()))
    everyone = [regions]
    if _distributed():
        everyone = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(everyone, regions, group=process_group)
    totals: dict[str, list[float]] = {}
    seen = set()
    for name, offset, shape, total, squares, count in (r for part in everyone for r in part):
        if (name, offset, shape) in seen:  # a replica of a region already counted
            continue
        seen.add((name, offset, shape))
        entry = totals.setdefault(name, [0.0, 0.0, 0])
        entry[0] += total
        entry[1] += squares
        entry[2] += count
    return totals


def check_same_frozen(model: nn.Module, marker: dict[str, Any], path: str, process_group=None) -> None:
    """Raise ``ValueError`` on every rank when a frozen tensor the checkpoint's run trained on differs
    from this model's (checkpoints without a fingerprint pass). Collective when distributed."""
    saved = (marker.get("model_tensors") or {}).get("frozen_fingerprint")
    if not saved:
        return
    now = frozen_fingerprint(model, process_group)
    differ = []
    for name, (total, squares, count) in saved.items():
        if name not in now:
            continue  # frozen then, trainable or absent now: check_same_trainable names it
        total_now, squares_now, count_now = now[name]
        scale = (squares * count) ** 0.5 + 1e-30  # bounds the sum of magnitudes (Cauchy-Schwarz)
        if (
            count_now != count
            or abs(total_now - total) > _FINGERPRINT_RTOL * scale
            or abs(squares_now - squares) > _FINGERPRINT_RTOL * (squares + 1e-30)
        ):
            differ.append(name)
    if differ:
        raise ValueError(
            f"{path} was trained on another frozen base: {_listed(differ)} differ from the tensors this "
            f"model holds (sum or sum of squares); nothing was loaded. Its adapters only make sense on "
            f"the base they were trained on: build this model from the same weights (weights=, "
            f"from_pretrained, seed) as the run that saved it."
        )


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
            f"peft config), or resume from a checkpoint saved with save_frozen=True."
        )
