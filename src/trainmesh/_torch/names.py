"""Parameter and module names as the user's model has them, whatever wrappers trainmesh added."""

from __future__ import annotations

_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """A tensor's or module's name without the wrappers' path parts (checkpointing, compile)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)
