"""Activation bytes, measured: a fake forward records every tensor autograd saves for backward.

The forward runs on fake tensors that claim the real device (see ``meta_model.to_fake``), under
the precision's autocast, inside ``torch.autograd.graph.saved_tensors_hooks``. The pack hook sees
each tensor saved for backward; bytes are summed once per storage (views and a tensor saved by
two ops count once) and parameter/buffer storages are left out (they are in the params column).
The model's output is added: it is alive until the loss is computed. Not counted: what the loss
function saves (e.g. the log-softmax of the logits) and backward's own temporaries.

Activation checkpointing is planned from the same forward: each saved storage is attributed to
the innermost checkpointed module running when it was saved. Non-reentrant checkpointing keeps a
checkpointed module's inputs instead of what it saved; at backward one module is recomputed at a
time, so the largest module's own saved bytes are added as a transient. The modules come from
``trainmesh._torch.activation_checkpointing.checkpointed_module_paths`` when that exists.

>>> import torch
>>> from trainmesh.planner.meta_model import build_meta_model
>>> model = build_meta_model(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
>>> measure_activations(model, torch.zeros(4, 8, device="meta"), "fp32").total_bytes
256
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass
class ActivationProfile:
    """Saved storages of one forward: ``key -> (bytes, owner path or None)``, plus module inputs."""

    saved: dict[int, tuple[int, str | None]] = field(default_factory=dict)
    inputs: dict[str, dict[int, int]] = field(default_factory=dict)  # path -> {storage key: bytes}

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.saved.values())

    def with_checkpointing(self, paths: list[str]) -> tuple[int, int]:
        """(kept bytes, recompute transient bytes) when the modules at ``paths`` are checkpointed."""
        kept = {key: nbytes for key, (nbytes, owner) in self.saved.items() if owner not in paths}
        for path in paths:
            kept.update(self.inputs.get(path, {}))
        own = {path: 0 for path in paths}
        for nbytes, owner in self.saved.values():
            if owner in own:
                own[owner] += nbytes
        return sum(kept.values()), max(own.values(), default=0)


def _to_fake_input(value: Any, mode, device: str, precision: str) -> Any:
    def convert(t):
        if not isinstance(t, torch.Tensor):
            return t
        dtype = torch.bfloat16 if precision == "bf16-true" and t.is_floating_point() else t.dtype
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)

    with mode:
        return torch.utils._pytree.tree_map(convert, value)


def measure_activations(
    meta_model: nn.Module,
    example_input: Any,
    precision: str,
    *,
    checkpoint_paths: list[str] | None = None,
    device: str = "cpu",
) -> ActivationProfile:
    """Run one fake forward of ``meta_model`` on ``example_input`` (real, meta or fake tensors; a tuple
    is unpacked into positional arguments) and record what is saved for backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .meta_model import to_fake

    if precision == "bf16-true":
        meta_model = meta_model.to(torch.bfloat16)  # meta: free; as the Trainer's convert_module does
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = to_fake(meta_model, mode, device)
    args = _to_fake_input(example_input, mode, device, precision)
    args = args if isinstance(args, tuple) else (args,)
    modules = dict(model.named_modules())
    missing = [p for p in checkpoint_paths or [] if p not in modules]
    if missing:
        raise ValueError(f"No module at checkpointed paths {missing}")
    profile = ActivationProfile()
    weights = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    keep_alive: list[Any] = []  # storages stay referenced so their keys cannot be reused mid-forward
    stack: list[str] = []

    def key_of(t: torch.Tensor) -> tuple[int, int]:
        storage = t.untyped_storage()
        keep_alive.append(storage)
        return storage._cdata, storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key, nbytes = key_of(t)
        if key not in weights and key not in profile.saved:
            profile.saved[key] = (nbytes, stack[-1] if stack else None)
        return t

    handles = []
    for path in checkpoint_paths or []:

        def pre(module, inputs, path=path):
            stack.append(path)
            profile.inputs[path] = dict(key_of(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))

        def post(module, inputs, output, path=path):
            stack.pop()

        handles += [modules[path].register_forward_pre_hook(pre), modules[path].register_forward_hook(post)]
    dtype = _AUTOCAST.get(precision)
    autocast = torch.autocast(device.split(":")[0], dtype=dtype) if dtype else contextlib.nullcontext()
    try:
        with mode, autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = model(*args)
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor):
                key, nbytes = key_of(t)
                profile.saved.setdefault(key, (nbytes, None))
    finally:
        for handle in handles:
            handle.remove()
    return profile


def checkpoint_paths(meta_model: nn.Module, policy: str | None) -> list[str]:
    """Outermost module paths ``policy`` checkpoints, from the activation-checkpointing module when present.

    Without it, "full" means every repeated block, "every:K" every K-th block and anything else a
    regex matched in full against module paths; "selective" needs that module.
    """
    if policy is None:
        return []
    try:
        from trainmesh._torch.activation_checkpointing import checkpointed_module_paths
    except ImportError:
        paths = _fallback_paths(meta_model, policy)
    else:
        paths = list(checkpointed_module_paths(meta_model, policy))
    # A module inside a checkpointed one is recomputed with it; only the outermost counts.
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]


def _fallback_paths(meta_model: nn.Module, policy: str) -> list[str]:
    import re

    from .meta_model import find_blocks

    blocks = find_blocks(meta_model)
    if policy == "full":
        return blocks
    if policy.startswith("every:"):
        k = int(policy.split(":", 1)[1])
        if k < 1:
            raise ValueError(f"every:K needs K >= 1. Received: activation_checkpointing={policy!r}")
        return blocks[::k]  # blocks 0, K, 2K, ... as the checkpointing module picks them
    if policy == "selective":
        raise ValueError(
            "activation_checkpointing='selective' needs trainmesh._torch.activation_checkpointing, "
            "which this installation lacks"
        )
    pattern = re.compile(policy)
    return [path for path, _ in meta_model.named_modules() if path and pattern.fullmatch(path)]
