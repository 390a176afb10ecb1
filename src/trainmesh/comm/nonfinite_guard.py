"""Non-finite gradients and compressor state: a step whose bucket holds an inf or NaN (an fp16
overflow, a NaN loss the Trainer then skips) leaves the error-feedback state as it was before it.

It exists apart from ``ddp_hooks.py`` because the DDP hook and the ZeRO reduce-scatter
(``reduce_scatter.py``) both guard their compressor's state this way.
"""

from __future__ import annotations

import torch

from trainmesh.compression.base import Compressor


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite: ``torch.isfinite(tensor).all()``, faster.

    Min and max propagate NaN and are infinite exactly when an element is, and ``aminmax`` runs
    at memory speed, where ``isfinite`` on CPU takes ~10 ns per element (measured: 14-18 ms for a
    6 MB bucket, more than the int8 quantisation of it; the hook checks every bucket every step).
    """
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


class KeepStateIfNonFinite:
    """Snapshot ``keys``' compressor state when ``tensor`` is not finite; ``restore`` puts it back.

    Compressors replace their per-key tensors on every compress (never update them in place),
    so keeping the old references is the whole snapshot.
    """

    FIELDS = ("residuals", "q_memory", "momentum_buffers", "steps")

    def __init__(self, compressor: Compressor, keys: list[str], tensor: torch.Tensor) -> None:
        self.compressor = compressor
        self.finite = all_finite(tensor)
        self.saved = (
            {}
            if self.finite
            else {
                field: {k: getattr(compressor, field).get(k) for k in keys}
                for field in self.FIELDS
                if isinstance(getattr(compressor, field, None), dict)
            }
        )

    def restore(self) -> None:
        for field, values in self.saved.items():
            table = getattr(self.compressor, field)
            for key, value in values.items():
                if value is None:
                    table.pop(key, None)
                else:
                    table[key] = value


__all__ = ["KeepStateIfNonFinite", "all_finite"]
