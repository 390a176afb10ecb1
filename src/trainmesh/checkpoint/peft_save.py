"""``save_pretrained`` of a peft LoRA model: the adapters in peft's format, or the merged full model.

Both reuse ``hf_save``'s collective plan and streaming (so every layout works the same way); only
what is written changes:

* adapters (the default): the active adapter's tensors under the names peft's own
  ``get_peft_model_state_dict`` gives them (``...q_proj.lora_A.weight``), in one
  ``adapter_model.safetensors``, beside the adapter's ``adapter_config.json``. Adapters are small:
  one file, whatever ``max_shard_size`` says.
* ``merge_adapters=True``: the base model's tensors under the base model's own names
  (``adapters.base_checkpoint_name``), each LoRA base weight plus ``scaling * B @ A`` as peft's
  ``merge_and_unload`` computes it, in the Hugging Face layout with the base's ``config.json``.
  The two factors are gathered whole up front (``r x (in + out)`` per layer: small, and a
  collective every process joins in the same order); each process then adds its own region of
  the product to its own shard when that shard is written, so no base weight is held whole.
  Under a pipeline each stage merges the layers it holds (the factors are gathered over its own
  model axis only), and its merged tensors travel to their writers as any stage's tensors do.

Under a pipeline the adapter names peft gives are made on each stage for its own layers and
gathered once, so every process renames the whole plan alike.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from ..distribution.adapters import base_checkpoint_name, is_lora_layer, is_peft_model
from . import hf_layout
from .integrity import fsync_path

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def view_for(model: nn.Module, merge_adapters: bool):
    """What ``save_pretrained`` writes of ``model``: None (its own tensors) or a peft view."""
    from .._torch.sync import unwrap

    module = unwrap(model)
    if not is_peft_model(module):
        if merge_adapters:
            raise ValueError(
                f"merge_adapters=True needs a peft model (peft.get_peft_model); "
                f"{type(module).__name__} has no LoRA adapters. Received: merge_adapters=True"
            )
        return None
    if not callable(getattr(module, "get_base_model", None)):
        raise TypeError(
            f"A peft model is saved from its PeftModel (what peft.get_peft_model returns). "
            f"Received: {type(module).__name__}"
        )
    if merge_adapters:
        return MergedView(module)
    return AdapterView(module, pipelined=getattr(model, "_trainmesh_pipeline", None) is not None)


class AdapterView:
    adapters_only = True

    def __init__(self, peft_model: nn.Module, pipelined: bool = False):
        from peft.utils import get_peft_model_state_dict

        self.peft_model = peft_model
        self.adapter = peft_model.active_adapter
        # peft's own naming, applied to placeholders: which model tensors it saves, under which names
        names = [n for n, _ in peft_model.named_parameters()] + [n for n, _ in peft_model.named_buffers()]
        placeholders = {name: torch.empty(0) for name in names}
        saved = get_peft_model_state_dict(peft_model, state_dict=placeholders, adapter_name=self.adapter)
        by_id = {id(t): name for name, t in placeholders.items()}
        self.names = {by_id[id(t)]: key for key, t in saved.items()}  # model name -> peft's saved name
        if pipelined:  # each stage named its own layers' adapters; the plan renames every stage's
            self.names = _union_over_processes(self.names)

    def max_bytes(self, _requested: int) -> int:
        return 1 << 62  # one file

    def local_state(self, model: nn.Module, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: value for name, value in local.items() if name in self.names}

    def rename(self, items: list, files: list) -> None:
        for item in items:
            item.entry.name = self.names[item.source]
        files[0].filename = ADAPTER_WEIGHTS

    def save_config(self, staging: str) -> list[str]:
        config = self.peft_model.peft_config[self.adapter]
        config.save_pretrained(staging)
        fsync_path(os.path.join(staging, ADAPTER_CONFIG))
        return [ADAPTER_CONFIG]

    def commit(self, staging: str, directory: str, files: list, extra: list[str]) -> None:
        """The config first, the weights last: a directory holding the new weights is complete."""
        for name in extra + [ADAPTER_WEIGHTS]:
            hf_layout.publish(staging, directory, name)
        fsync_path(directory)
        shutil.rmtree(staging, ignore_errors=True)


def _union_over_processes(names: dict[str, str]) -> dict[str, str]:
    """Every process's name mapping, merged (collective: ``save_pretrained`` runs everywhere)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return names
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, names)
    return {source: saved for part in parts for source, saved in part.items()}


class MergedView:
    adapters_only = False

    def __init__(self, peft_model: nn.Module):
        self.peft_model = peft_model
        self.adapter = peft_model.active_adapter

    def max_bytes(self, requested: int) -> int:
        return requested

    def local_state(self, model: nn.Module, local: dict[str, torch.Tensor]) -> "_MergedState":
        from .._torch.shard_ranges import full_tensor

        deltas: dict[str, tuple] = {}
        for path, layer in self.peft_model.named_modules():  # the same order on every process
            if not is_lora_layer(layer) or self.adapter not in layer.lora_A:
                continue
            _check_mergeable(path, layer, self.adapter)
            a = full_tensor(layer.lora_A[self.adapter].weight).float()
            b = full_tensor(layer.lora_B[self.adapter].weight).float()
            deltas[f"{path}.base_layer.weight"] = (
                a,
                b,
                float(layer.scaling[self.adapter]),
                bool(getattr(layer, "fan_in_fan_out", False)),
            )
        adapter_names = {
            n
            for n in local
            if any(
                f".{attr}." in n
                for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
            )
        }
        kept = {name: value for name, value in local.items() if name not in adapter_names}
        return _MergedState(kept, deltas)

    def rename(self, items: list, files: list) -> None:
        for item in items:  # before the index is written: it lists the renamed entries
            item.entry.name = base_checkpoint_name(item.entry.name)


def _check_mergeable(path: str, layer: nn.Module, adapter: str) -> None:
    if (getattr(layer, "use_dora", {}) or {}).get(adapter) or (getattr(layer, "lora_bias", {}) or {}).get(adapter):
        raise ValueError(
            f"merge_adapters=True merges plain LoRA (B @ A); {path!r} uses DoRA or a LoRA bias. "
            f"Save the adapters and merge with peft's merge_and_unload. Received: adapter={adapter!r}"
        )
    if not isinstance(layer.lora_A[adapter], nn.Linear):
        raise ValueError(
            f"merge_adapters=True merges Linear / Conv1D LoRA layers; {path!r} is "
            f"{type(layer).__name__}. Received: adapter={adapter!r}"
        )


class _MergedState(dict):
    """The local state, where reading a LoRA base weight gives it merged: ``items()`` (dict's own, what
    the plan reads: shapes, dtypes, shard runs) gives the tensors as they are, ``[name]`` the merged
    value, computed when its piece is written."""

    def __init__(self, local: dict[str, torch.Tensor], deltas: dict[str, tuple]):
        super().__init__(local)
        self.deltas = deltas

    def __getitem__(self, name: str) -> torch.Tensor:
        value = super().__getitem__(name)
        if name not in self.deltas:
            return value
        return _merged(value, *self.deltas[name])


def _merged(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool
) -> torch.Tensor:
    """``weight`` (a local shard or a whole tensor) plus its region of ``scaling * B @ A``."""
    from torch.distributed.tensor import DTensor

    from .._torch.shard_ranges import local_region

    delta = (b @ a) * scaling
    if fan_in_fan_out:
        delta = delta.T  # transformers' Conv1D stores its weight in x out
    local, offsets, shape = local_region(weight)
    region = delta[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
    merged = (local.detach().float() + region.to(local.device)).to(local.dtype)
    if isinstance(weight, DTensor):
        return DTensor.from_local(
            merged, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride()
        )
    return merged


__all__ = ["view_for", "ADAPTER_WEIGHTS", "ADAPTER_CONFIG"]
