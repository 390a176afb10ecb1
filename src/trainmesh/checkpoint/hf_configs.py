"""The model's ``config.json`` and ``generation_config.json``: found under the wrappers, written as
transformers' ``save_pretrained`` writes them, with the dtype holding the most bytes recorded.

It exists apart from ``hf_layout.py`` because it is the model's description, not its tensors:
written into the staging folder beside the shards, published by the same commit.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .integrity import fsync_path

if TYPE_CHECKING:
    from .hf_file_plan import Entry


def find_pretrained(model: nn.Module | None) -> nn.Module | None:
    """The transformers model in ``model`` or under its wrappers (DDP, compile, peft), if any."""
    queue, seen = [model], set()
    while queue:
        module = queue.pop(0)
        if not isinstance(module, nn.Module) or id(module) in seen:
            continue
        seen.add(id(module))
        config = vars(module).get("config")
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            return module
        queue += [vars(module).get("_modules", {}).get(a) for a in ("module", "_orig_mod", "base_model", "model")]
    return None


def configs_of(pretrained: nn.Module | None) -> tuple[Any, Any, str | None]:
    """(config, generation_config, architecture name) of a transformers model, or Nones."""
    if pretrained is None:
        return None, None, None
    can_generate = getattr(pretrained, "can_generate", lambda: True)()
    generation_config = getattr(pretrained, "generation_config", None) if can_generate else None
    return vars(pretrained).get("config"), generation_config, type(pretrained).__name__.removeprefix("FSDP")


def save_configs(
    directory: str,
    config: Any,
    generation_config: Any = None,
    architecture: str | None = None,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write ``config.json`` (+ ``generation_config.json``) as transformers' ``save_pretrained`` does."""
    if config is None:
        return []
    config = copy.deepcopy(config)
    if architecture is not None:
        config.architectures = [architecture]
    if dtype is not None:
        config.dtype = str(dtype).split(".")[-1]
    config.save_pretrained(directory)
    written = ["config.json"]
    if generation_config is not None and callable(getattr(generation_config, "save_pretrained", None)):
        generation_config.save_pretrained(directory)
        written.append("generation_config.json")
    for name in written:
        fsync_path(os.path.join(directory, name))
    return written


def main_dtype(entries: list[Entry]) -> torch.dtype | None:
    """The floating dtype holding the most bytes (what ``config.dtype`` records)."""
    sizes: dict[torch.dtype, int] = {}
    for entry in entries:
        if entry.dtype.is_floating_point:
            sizes[entry.dtype] = sizes.get(entry.dtype, 0) + entry.nbytes
    return max(sizes, key=sizes.get) if sizes else None
