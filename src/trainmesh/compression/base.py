"""Shared types of the compressors: what travels (:class:`Compressed`) and the transform (:class:`Compressor`).

A compressor is a pure tensor transform with per-key state (error-feedback residuals,
momentum, warm-start factors). It never communicates: a DDP hook or a reduce-scatter decides
how the compressed tensors travel (all-reduce when ``summable``, all-gather otherwise).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class Compressed:
    """What a compressor sends: ``tensors`` travel, ``meta`` (JSON-able) is known to the receiver."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of ``tensors``: what goes on the wire."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown dtype name in compressed meta. Received: dtype={name!r}")
    return dtype


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Residuals of half-precision gradients are kept in fp32: a half residual would drop the
    small corrections error feedback exists to keep."""
    return torch.float32 if dtype in _HALF_DTYPES else dtype


def tensor_meta(tensor: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """What every receiver needs to rebuild the dense tensor (``dtype``: the caller's dtype)."""
    return {"shape": list(tensor.shape), "dtype": dtype_name(dtype), "numel": tensor.numel()}


class Compressor(abc.ABC):
    """Base of every compressor; subclasses implement ``_encode`` and ``decompress``.

    ``compress(tensor, key)`` adds ``key``'s residual first when error feedback is on and keeps
    ``residual = corrected - decompress(compressed)``, so that over any number of steps
    ``sum(sent) + residual == sum(true tensors)``.
    """

    name: str = ""
    summable: bool = False
    # True when compressing each tensor equals compressing their concatenation and the compressor
    # keeps no per-key state (without error feedback): a DDP hook may then compress a whole bucket
    # in one call. Cast compressors are; top-k (k per tensor), int8 (chunks) and PowerSGD are not.
    elementwise: bool = False
    error_feedback: bool = False
    # State fields (dicts keyed by tensor key) that are averaged over ranks when the world size
    # changes (see resize_residuals); every other dict field is per-rank bookkeeping.
    _MEAN_FIELDS: tuple[str, ...] = ("residuals",)
    # Per-key integer counters (steps taken): the largest is kept on a resize.
    _COUNTER_FIELDS: tuple[str, ...] = ()

    def __init__(self, *, error_feedback: bool = False) -> None:
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool. Received: error_feedback={error_feedback!r}")
        self.error_feedback = error_feedback
        self.residuals: dict[str, torch.Tensor] = {}

    # ---- the transform -------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, key: str = "") -> Compressed:
        """Compress ``tensor`` (plus ``key``'s residual when error feedback is on)."""
        self._check_input(tensor, key)
        corrected = self._add_residual(tensor, key)
        compressed = self._encode(corrected, key, tensor.dtype)
        self._keep_residual(key, corrected, compressed)
        return compressed

    @abc.abstractmethod
    def _encode(self, corrected: torch.Tensor, key: str, dtype: torch.dtype) -> Compressed:
        """Compress ``corrected`` (already residual-corrected); ``dtype`` is the caller's dtype."""

    @abc.abstractmethod
    def decompress(self, compressed: Compressed) -> torch.Tensor:
        """Dense tensor of the original shape and dtype."""

    def add_to(self, total: torch.Tensor, compressed: Compressed) -> None:
        """``total += decompress(compressed)``, ``total`` of the same number of elements (any shape, in
        its own dtype): how an all-gather or all-to-all sums the payloads it received. A sparse
        compressor adds only the entries it sent."""
        total += self.decompress(compressed).reshape(total.shape).to(total.dtype)

    # ---- error feedback ------------------------------------------------------------------
    def _check_input(self, tensor: torch.Tensor, key: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{self.name}: compress expects a torch.Tensor. Received: {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise ValueError(f"{self.name}: compress expects a floating-point tensor. Received: dtype={tensor.dtype}")
        if not isinstance(key, str):
            raise TypeError(f"{self.name}: key must be a str. Received: key={key!r}")

    def _add_residual(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        corrected = tensor.detach().to(work_dtype(tensor.dtype))
        if not self.error_feedback:
            return corrected
        residual = self.residuals.get(key)
        if residual is None:
            return corrected.clone()
        if residual.shape != tensor.shape:
            raise ValueError(
                f"{self.name}: key {key!r} was compressed before with shape {tuple(residual.shape)}; "
                f"a residual cannot be added to shape {tuple(tensor.shape)}. Use one key per tensor."
            )
        return corrected + residual.to(device=corrected.device, dtype=corrected.dtype)

    def _keep_residual(self, key: str, corrected: torch.Tensor, compressed: Compressed) -> None:
        if self.error_feedback:
            self.residuals[key] = corrected - self.decompress(compressed).to(corrected.dtype)

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain dict of CPU tensors and numbers (``torch.save`` and DCP friendly)."""
        return {"residuals": {k: v.detach().to("cpu", copy=True) for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"{self.name}: load_state_dict expects a dict. Received: {type(state).__name__}")
        residuals = state.get("residuals", {})
        if not isinstance(residuals, dict) or not all(isinstance(v, torch.Tensor) for v in residuals.values()):
            raise ValueError(f"{self.name}: state['residuals'] must map keys to tensors. Received: {residuals!r:.200}")
        # Kept on CPU until the next compress moves them next to the gradient.
        self.residuals = {k: v.detach().clone() for k, v in residuals.items()}

    @classmethod
    def resize_residuals(cls, states: list[dict], new_world_size: int) -> list[dict]:
        """Redistribute per-rank states (one per old rank) to ``new_world_size`` ranks.

        Gradients are averaged over ranks, so the residual mass that matters is the mean:
        every new rank gets the mean over old ranks of each residual (a key missing on a rank
        counts as zero), which keeps ``sum_r e_r / N_old == sum_j e'_j / N_new``. Counters keep
        their largest value; other per-rank fields come from old rank ``j % N_old``.
        """
        if not isinstance(states, (list, tuple)) or not states or not all(isinstance(s, dict) for s in states):
            raise ValueError(f"resize_residuals expects a non-empty list of state dicts. Received: {states!r:.200}")
        if not isinstance(new_world_size, int) or isinstance(new_world_size, bool) or new_world_size < 1:
            raise ValueError(f"new_world_size must be a positive int. Received: new_world_size={new_world_size!r}")
        old = len(states)
        averaged: dict[str, dict[str, torch.Tensor]] = {}
        for name in cls._MEAN_FIELDS:
            keys = sorted({k for s in states for k in s.get(name, {})})
            averaged[name] = {}
            for k in keys:
                present = [s[name][k] for s in states if k in s.get(name, {})]
                total = torch.zeros_like(present[0], dtype=torch.float64)
                for t in present:
                    total += t.to(torch.float64)
                averaged[name][k] = (total / old).to(present[0].dtype)
        counters = {name: {} for name in cls._COUNTER_FIELDS}
        for name in cls._COUNTER_FIELDS:
            for s in states:
                for k, v in s.get(name, {}).items():
                    counters[name][k] = max(int(v), counters[name].get(k, 0))
        out = []
        for j in range(new_world_size):
            new = {name: value for name, value in states[j % old].items()}
            for name, per_key in averaged.items():
                new[name] = {k: v.clone() for k, v in per_key.items()}
            for name, per_key in counters.items():
                new[name] = dict(per_key)
            out.append(new)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, error_feedback={self.error_feedback})"
