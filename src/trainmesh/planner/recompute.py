"""Activation checkpointing, measured in a dry run (``dry_run.measure_step``): which modules a
policy checkpoints, and the bytes a checkpointed module's re-run holds in backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def checkpointed_modules(model: nn.Module, policy: Any) -> list[nn.Module]:
    """The modules ``policy`` checkpoints (outermost only), asked of the checkpointing module itself."""
    if policy is None:
        return []
    from trainmesh._torch.activation_checkpointing import checkpointed_module_paths

    paths = list(checkpointed_module_paths(model, policy))
    paths = [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]
    return [model.get_submodule(p) for p in paths]


class RecomputeBytes(TorchDispatchMode):
    """Activation checkpointing, measured: in forward a checkpointed module keeps only its inputs
    (added to ``saved``); in backward it is run again, and the bytes its re-run creates are alive
    together until its backward is done: the largest such re-run is the recompute transient."""

    def __init__(self, regions: list[nn.Module], saved: dict[int, int]):
        super().__init__()
        self.saved, self.backward, self.peak = saved, False, 0
        self.current: dict[int, int] | None = None
        self.handles = []
        for module in regions:
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._exit))

    def _enter(self, module, inputs):
        if not self.backward:
            for t in tree_leaves(inputs):
                if isinstance(t, torch.Tensor):
                    self.saved.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
        else:
            self.current = {}

    def _exit(self, module, inputs, output):
        if self.backward and self.current is not None:
            self.peak = max(self.peak, sum(self.current.values()))
            self.current = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.current is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.current.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
