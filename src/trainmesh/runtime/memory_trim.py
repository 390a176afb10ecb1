"""Give freed host memory back to the system, so RSS follows the live tensors.

Why: on CPU processes every tensor comes from glibc malloc, which ``host_allocator.py`` tunes to keep
what a step frees (tensors up to 256 MiB from the heap, up to 1 GiB free at its top kept) so the next
step reuses it without page faults. Memory freed once and not needed again (what building and
loading a sharded model freed, fragments left between the tensors that stay) stays resident too.
``benchmarks/finetune.py`` measured the ZeRO-3 LoRA run's peak RSS at 0.645 of full fine-tuning's while
its live tensors peaked at 0.47.

What: ``malloc_trim(0)`` (glibc >= 2.8 also releases whole free pages inside the heap, not only its
top) before the first training forward of a sharded model (after building, loading and any
evaluation) and every ``EVERY_STEPS`` training forwards after (that is after an optimizer step and
``zero_grad``), only when the main arena holds at least ``MIN_FREE_BYTES`` free (``mallinfo2``, about
20 us). Measured on a loaded 2-core machine: the trim costs about 0.25 ms per MiB released (400 MiB:
90 ms), and faulting the same 400 MiB in again about a second more than reusing it; hence not every
step: what a step frees, the next one needs again. glibc Linux only; elsewhere a no-op.
``TRAINMESH_MALLOC_TRIM=0`` turns it off (``benchmarks/finetune.py`` measures with and without).
The allocator keeps its settings: a trim only returns pages nobody holds.
"""

from __future__ import annotations

import ctypes
import os
import sys

# The main arena's free bytes that make a trim worth its cost (see the module docstring).
MIN_FREE_BYTES = 64 * 2**20
# Not every step: what a step frees (gathers, activations) the next step needs again, and
# ``host_allocator.py`` keeps it resident on purpose (no page faults per step).
EVERY_STEPS = 1000


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _load_glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p  # glibc only: musl has no mallinfo2 to rely on
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_glibc()


def free_heap_bytes() -> int | None:
    """Bytes glibc's main arena holds free (``mallinfo2().fordblks``); None where that is not glibc."""
    return int(_LIBC.mallinfo2().fordblks) if _LIBC is not None else None


def trim_if_worth_it(min_free_bytes: int = MIN_FREE_BYTES) -> bool:
    """``malloc_trim(0)`` when the main arena holds at least ``min_free_bytes`` free; whether it ran."""
    free = free_heap_bytes() if os.environ.get("TRAINMESH_MALLOC_TRIM", "1") != "0" else None
    if free is None or free < min_free_bytes:
        return False
    _LIBC.malloc_trim(0)
    return True


def trim_before_training_forward(module, args) -> None:
    """A forward pre-hook for a sharded model's root: trims before the first training forward (what
    building and loading freed) and every ``EVERY_STEPS`` training forwards after (fragmentation)."""
    if module.training and _grad_enabled():
        count = getattr(module, "_trainmesh_trim_count", 0)
        module._trainmesh_trim_count = count + 1
        if count % EVERY_STEPS == 0:
            trim_if_worth_it()


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def install(model) -> None:
    """Trim between the steps of ``model`` (host memory only: a CUDA run's host heap holds no gathers)."""
    if _LIBC is not None and not getattr(model, "_trainmesh_trim_hook", None):
        model._trainmesh_trim_hook = model.register_forward_pre_hook(trim_before_training_forward)
