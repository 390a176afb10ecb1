"""One-file weights for the world outside trainmesh: consolidated safetensors export/import.

``export_consolidated`` gathers the full, unwrapped model state (no DDP ``module.`` prefix,
no DTensor) and rank 0 writes one ``.safetensors`` file, which plain PyTorch loads with
``model.load_state_dict(safetensors.torch.load_file(path))``. ``load_initial_weights`` goes
the other way: such a file (or a ``torch.save``'d state dict) into a possibly-sharded model.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .. import runtime
from .._torch import dcp as _dcp
from .integrity import fsync_path


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as exc:  # an optional extra: say how to get it
        raise ImportError("Consolidated export needs safetensors: pip install 'trainmesh[checkpoint]'") from exc
    return st


def export_consolidated(path: str | os.PathLike, model: nn.Module, *, metadata: dict[str, str] | None = None) -> str:
    """Write the full state of ``model`` to ``path`` (a ``.safetensors`` file). Collective.

    >>> export_consolidated("model.safetensors", trainer.model)   # doctest: +SKIP
    """
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        raise ValueError(
            f"export_consolidated writes safetensors; give a path ending in .safetensors. Received: path={path!r}"
        )
    st = _safetensors()
    state = _dcp.full_model_state_on_rank0(model)  # every rank takes part in the gather
    if runtime.rank() == 0:
        # safetensors refuses tensors sharing storage (tied weights) and non-contiguous views.
        tensors, seen = {}, {}
        for name, value in state.items():
            if not torch.is_tensor(value):
                continue
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
            tensors[name] = value.detach().clone().contiguous() if key in seen else value.detach().contiguous()
            seen[key] = name
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".part"
        st.save_file(tensors, tmp, metadata={"format": "pt", **(metadata or {})})
        fsync_path(tmp)
        os.replace(tmp, path)
    runtime.barrier()
    return path


def _read_state(path: str) -> dict[str, Any]:
    if path.endswith(".safetensors"):
        return _safetensors().load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]  # a trainmesh/torch training checkpoint: take its model part
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict (found {type(state).__name__}).")
    return state


def load_initial_weights(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load a full state dict file (safetensors or torch) into ``model``; works on DDP/FSDP2/TP models.

    Every rank reads the file (it must be on a file system they share) and keeps its own
    shards. Collective when ``model`` is distributed. Returns ``model``.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"No initial-weights file at path={path!r}")
    state = _read_state(path)
    _dcp.load_full_model_state(model, state, strict=strict)
    return model
