"""``apply_compile``: ``torch.compile`` on the whole model or on each repeated block (torchtitan's
"regional" compilation), in place.

Modes: ``False`` (eager), ``True`` (the whole model), ``"regional"`` (each block of each outermost
repeated-block container, found by the same rule activation checkpointing and FSDP units use; the
default when compiling). Regional compilation is what torchtitan does: the blocks share one code
path, so dynamo traces one block and reuses the graph for the others (compile time stays that of one
block), and FSDP2's per-block hooks stay outside the compiled regions.

Mechanism: each target's ``forward`` is replaced, on the instance, by ``torch.compile`` of it. Unlike
wrapping in ``torch.compile(module)`` it inserts no ``_orig_mod`` submodule, so parameter names,
``state_dict`` keys, LayoutMap keys, checkpoints and optimizer rebinding are unchanged; and the
module's hooks (FSDP2's all-gathers) run outside the compiled region. ``nn.Module.compile()`` would
also keep the names, but on torch 2.11 (seen on a CUDA machine, Python 3.12) dynamo skipped the
``_call_impl`` it compiles: not one frame was traced and the model ran eager without a word.

Where compilation cannot work here (dynamo unsupported on this Python, inductor on CPU without a C++
compiler), a warning names the reason and the model runs eager: the result is the same, only slower.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from typing import Any

import torch
from torch import nn

__all__ = [
    "COMPILE_MODES",
    "apply_compile",
    "check_compile_mode",
    "check_inductor_mode",
    "compile_unavailable_reason",
    "compiled_mode",
    "is_compiled_in_place",
]

COMPILE_MODES = (False, True, "regional")
_MARK = "_trainmesh_compile"


def check_compile_mode(mode: Any) -> Any:
    """``mode`` if it is one of ``COMPILE_MODES``; ValueError naming it otherwise."""
    if not any(mode is m or (isinstance(m, str) and mode == m) for m in COMPILE_MODES):
        raise ValueError(
            f"compile must be False, True (the whole model) or 'regional' (each repeated block). "
            f"Received: compile={mode!r}"
        )
    return mode


def check_inductor_mode(inductor_mode: str | None, backend: str = "inductor") -> str | None:
    """``inductor_mode`` (torch.compile's ``mode``: "default", "reduce-overhead" (CUDA graphs),
    "max-autotune", ...) if inductor knows it and the backend is inductor; ValueError otherwise.
    Other backends take no mode: torch would hand it to them as an argument they do not accept."""
    if inductor_mode is None:
        return None
    from torch._inductor import list_mode_options

    known = list(list_mode_options())
    if not isinstance(inductor_mode, str) or inductor_mode not in known:
        raise ValueError(
            f"compile_mode must be None or one of torch.compile's modes {known}. "
            f"Received: compile_mode={inductor_mode!r}"
        )
    if backend != "inductor":
        raise ValueError(
            f"compile_mode applies to the inductor backend only (torch.compile passes no mode to other "
            f"backends). Received: compile_mode={inductor_mode!r}, compile_backend={backend!r}"
        )
    return inductor_mode


def _cxx_compiler() -> str | None:
    """The C++ compiler inductor would call on CPU (its own setting, then $CXX, then the usual names)."""
    try:
        from torch._inductor import config as inductor_config

        configured = inductor_config.cpp.cxx
        candidates = [c for c in (configured if isinstance(configured, tuple) else (configured,)) if c]
    except Exception:  # an inductor build without the setting: the usual names only
        candidates = []
    candidates += [os.environ.get("CXX"), "g++", "c++", "clang++"]
    for name in candidates:
        if name and shutil.which(name):
            return name
    return None


def compile_unavailable_reason(backend: str = "inductor", device_type: str = "cpu") -> str | None:
    """Why ``torch.compile`` cannot run here, or None when it can (checked without compiling)."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile (dynamo) does not support this Python ({sys.version.split()[0]})"
    if torch._dynamo.config.disable:  # torch would run eager without a word
        return "torch.compile is switched off in this environment (TORCH_COMPILE_DISABLE=1 or torch._dynamo.config.disable)"
    if backend == "inductor" and device_type == "cpu" and _cxx_compiler() is None:
        return "inductor compiles CPU kernels with a C++ compiler, and none was found (set $CXX or install g++)"
    return None


def _block_paths(model: nn.Module) -> list[str]:
    """The repeated blocks, by the rule activation checkpointing and FSDP units share."""
    from .activation_checkpointing import checkpointed_module_paths

    try:
        return checkpointed_module_paths(model, "full")
    except ValueError:  # no repeated-block container
        return []


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether ``apply_compile`` compiled this module's ``forward``."""
    return hasattr(vars(module).get("forward"), "_torchdynamo_orig_callable")


def compiled_mode(model: nn.Module) -> Any:
    """The mode ``apply_compile`` applied to ``model`` (False when it ran eager)."""
    return getattr(model, _MARK, False)


def apply_compile(
    model: nn.Module,
    mode: Any,
    *,
    backend: str = "inductor",
    fullgraph: bool = False,
    device_type: str = "cpu",
    inductor_mode: str | None = None,
) -> nn.Module:
    """Compile ``model`` (``True``) or each of its repeated blocks (``"regional"``) in place; returns it.

    Call it after tensor layouts and activation checkpointing, before DDP / FSDP2 (see
    ``parallelize``). A model without repeated blocks is compiled whole under "regional".

    ``inductor_mode`` is torch.compile's ``mode`` (None: its default; "reduce-overhead" replays
    CUDA graphs, for steps made of many small kernel launches).

    >>> model = apply_compile(MyTransformer(), "regional")   # doctest: +SKIP
    """
    check_compile_mode(mode)
    check_inductor_mode(inductor_mode, backend)
    if mode is False:
        return model
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"compile backend must be a torch.compile backend name. Received: backend={backend!r}")
    reason = compile_unavailable_reason(backend, device_type)
    if reason is not None:
        warnings.warn(
            f"trainmesh: compile={mode!r} is not possible here: {reason}; the model runs eager.",
            RuntimeWarning,
            stacklevel=2,
        )
        setattr(model, _MARK, False)
        return model
    modules = dict(model.named_modules())
    paths = _block_paths(model) if mode == "regional" else []
    targets = [modules[path] for path in paths] or [model]
    for module in targets:
        module.forward = torch.compile(module.forward, backend=backend, fullgraph=fullgraph, mode=inductor_mode)
    setattr(model, _MARK, "regional" if paths else True)
    return model
