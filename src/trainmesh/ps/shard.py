"""``Shard``: one key range held by a server — its value, optimizer state and version clock.

A dense shard holds a flat part of a parameter (1-D); a sparse shard holds a row range of an
embedding table (2-D), created on the server from a deterministic init so a large table is
never sent. ``state_dict``/``from_state`` carry everything (value, optimizer state, version,
spec) for snapshots and for moving a shard to another server.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .optimizers import ServerOptimizer, make_optimizer
from .placement import split_shard_id

__all__ = ["Shard", "DEFAULT_INIT", "init_rows"]

DEFAULT_INIT = {"kind": "normal", "std": 0.01, "seed": 0}
_META_KEYS = {"shard_id", "kind", "version", "optimizer", "shape", "dtype", "init"}
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _normalize_init(init: Any) -> dict:
    if not isinstance(init, dict):
        raise TypeError(f"sparse init must be a dict, got {type(init).__name__}: {init!r}")
    kind = init.get("kind")
    if kind == "zeros":
        allowed = {"kind"}
        out: dict = {"kind": "zeros"}
    elif kind == "normal":
        allowed = {"kind", "std", "seed"}
        std, seed = init.get("std", DEFAULT_INIT["std"]), init.get("seed", DEFAULT_INIT["seed"])
        if isinstance(std, bool) or not isinstance(std, (int, float)) or not std >= 0:
            raise ValueError(f"sparse init: std must be a number >= 0, got {std!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"sparse init: seed must be an int, got {seed!r}")
        out = {"kind": "normal", "std": float(std), "seed": seed}
    else:
        raise ValueError(f"sparse init: unknown kind {kind!r}; expected 'normal' or 'zeros'")
    unknown = sorted(set(init) - allowed)
    if unknown:
        raise ValueError(f"sparse init ({kind}): unknown keys {unknown}; allowed: {sorted(allowed)}")
    return out


def init_rows(rows: int, dim: int, init: dict, name: str, index: int) -> torch.Tensor:
    """The initial ``(rows, dim)`` float32 value of part ``index`` of table ``name``.

    The generator seed is a hash of (seed, name, index): every server (and a test on one
    process) produces the same rows, independent of process and placement.
    """
    init = _normalize_init(init)
    if init["kind"] == "zeros":
        return torch.zeros(rows, dim)
    key = f"{init['seed']}\0{name}\0{index}".encode("utf-8")
    seed = int.from_bytes(hashlib.blake2b(key).digest()[:8], "big")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=generator).mul_(init["std"])


class Shard:
    """One key range. Build with ``Shard.dense``, ``Shard.sparse`` or ``Shard.from_state``."""

    def __init__(
        self,
        shard_id: str,
        kind: str,
        value: torch.Tensor,
        optimizer: ServerOptimizer,
        state: dict[str, torch.Tensor],
        version: int = 0,
        init: dict | None = None,
    ):
        self.shard_id = shard_id
        self.kind = kind  # "dense" or "sparse"
        self.value = value
        self.optimizer = optimizer
        self.state = state
        self._version_cell: torch.Tensor | None = None  # set while a RowStore holds the version
        self.version = version  # number of updates applied
        self.init = init

    @property
    def version(self) -> int:
        """Updates applied. While the range is packed in a ``RowStore`` the count lives in the
        store's per-slot tensor (``_version_cell`` is a one-element view of it), so a push
        advances every touched range's version in one tensor op, not a Python loop over them."""
        cell = self._version_cell
        return self._version if cell is None else int(cell[0])

    @version.setter
    def version(self, value: int) -> None:
        if self._version_cell is None:
            self._version = value
        else:
            self._version_cell[0] = value

    def keep_version_in(self, cell: torch.Tensor | None) -> None:
        """Move the version into ``cell`` (a one-element int64 view), or back out with None."""
        version = self.version
        self._version_cell = cell
        self.version = version

    # -- construction --------------------------------------------------------------------

    @classmethod
    def dense(cls, shard_id: str, value: torch.Tensor, optimizer_spec: dict) -> "Shard":
        """A dense part; ``value`` (1-D) is copied so the caller's tensor is never aliased."""
        _check_shard_id(shard_id)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() != 1:
            raise ValueError(
                f"dense shard {shard_id!r}: value must be a 1-D floating-point tensor, got {_describe(value)}"
            )
        optimizer = make_optimizer(optimizer_spec)
        value = value.detach().to("cpu", copy=True).contiguous()
        return cls(shard_id, "dense", value, optimizer, optimizer.init_state(value))

    @classmethod
    def sparse(
        cls,
        shard_id: str,
        rows: int,
        dim: int,
        optimizer_spec: dict,
        init: dict | None = None,
        *,
        name: str | None = None,
        index: int | None = None,
    ) -> "Shard":
        """A row range of a table, initialised from ``(init["seed"], name, index)``.

        ``name`` and ``index`` default to the parts of ``shard_id`` = ``f"{name}#{index}"``.
        """
        _check_shard_id(shard_id)
        for what, n in (("rows", rows), ("dim", dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"sparse shard {shard_id!r}: {what} must be an int >= 1, got {n!r}")
        if name is None or index is None:
            parsed_name, parsed_index = split_shard_id(shard_id)
            if not parsed_name or parsed_index is None:
                raise ValueError(f"sparse shard id {shard_id!r} is not 'name#index'; pass name= and index=")
            name = parsed_name if name is None else name
            index = parsed_index if index is None else index
        init = _normalize_init(DEFAULT_INIT if init is None else init)
        optimizer = make_optimizer(optimizer_spec)
        value = init_rows(rows, dim, init, name, index)
        return cls(shard_id, "sparse", value, optimizer, optimizer.init_state(value), init=init)

    # -- updates and reads ---------------------------------------------------------------

    def apply(self, grad: torch.Tensor, lr: float | None = None) -> None:
        """Apply a dense gradient (same shape as the value) and advance the version."""
        self._require("dense", "apply_rows")
        self.optimizer.step(self.value, grad, self.state, lr=lr)
        self.version += 1

    def apply_rows(self, local_rows: torch.Tensor, grads: torch.Tensor, lr: float | None = None) -> None:
        """Apply gradients ``(n, dim)`` to rows ``local_rows`` (duplicates summed)."""
        self._require("sparse", "apply")
        self.optimizer.step_rows(self.value, local_rows, grads, self.state, lr=lr)
        self.version += 1

    def read(self) -> torch.Tensor:
        """A copy of the whole value (safe to hold while later updates land)."""
        return self.value.clone()

    def read_rows(self, local_rows: torch.Tensor) -> torch.Tensor:
        """A copy of rows ``local_rows`` (int64, local to this shard)."""
        self._require("sparse", "read")
        rows = self.value.shape[0]
        if not isinstance(local_rows, torch.Tensor) or local_rows.dtype != torch.int64 or local_rows.dim() != 1:
            raise ValueError(
                f"shard {self.shard_id!r}: local_rows must be a 1-D int64 tensor, got {_describe(local_rows)}"
            )
        bad = (local_rows < 0) | (local_rows >= rows)
        if bool(bad.any()):
            raise ValueError(
                f"shard {self.shard_id!r}: local row {int(local_rows[bad][0])} out of range for {rows} rows"
            )
        return self.value[local_rows]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def optimizer_spec(self) -> dict:
        return self.optimizer.spec

    @property
    def nbytes(self) -> int:
        """Bytes held: value plus optimizer state."""
        tensors = [self.value, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- serialization -------------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``(tensors, meta)``; the tensors are the live ones (no copy): encode them before the
        next update. ``meta`` is JSON-able."""
        tensors = {"value": self.value, **{f"state.{k}": v for k, v in self.state.items()}}
        meta = {
            "shard_id": self.shard_id,
            "kind": self.kind,
            "version": self.version,
            "optimizer": self.optimizer.spec,
            "shape": list(self.value.shape),
            "dtype": str(self.value.dtype).removeprefix("torch."),
            "init": self.init,
        }
        return tensors, meta

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict) -> "Shard":
        """Rebuild a shard from ``state_dict()`` output, checking it is complete and consistent."""
        if not isinstance(meta, dict) or set(meta) != _META_KEYS:
            got = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
            raise ValueError(f"shard meta must have keys {sorted(_META_KEYS)}, got {got}")
        shard_id, kind, version = meta["shard_id"], meta["kind"], meta["version"]
        _check_shard_id(shard_id)
        where = f"shard {shard_id!r}"
        if kind not in ("dense", "sparse"):
            raise ValueError(f"{where}: kind must be 'dense' or 'sparse', got {kind!r}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"{where}: version must be an int >= 0, got {version!r}")
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{where}: unsupported dtype {meta['dtype']!r}")
        shape = tuple(meta["shape"]) if isinstance(meta["shape"], list) else None
        if shape is None or len(shape) != (1 if kind == "dense" else 2):
            raise ValueError(f"{where}: shape {meta['shape']!r} does not fit a {kind} shard")
        optimizer = make_optimizer(meta["optimizer"])
        init = None if kind == "dense" else _normalize_init(meta["init"])
        expected_state = optimizer.state_keys()
        expected = {"value", *(f"state.{k}" for k in expected_state)}
        if not isinstance(tensors, dict) or set(tensors) != expected:
            got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
            raise ValueError(f"{where}: expected tensors {sorted(expected)}, got {got}")
        if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError(f"{where}: every entry of tensors must be a torch.Tensor")
        value = tensors["value"]
        if value.dtype != _DTYPES[meta["dtype"]] or tuple(value.shape) != shape:
            raise ValueError(f"{where}: value is {_describe(value)}, meta says {meta['dtype']} {list(shape)}")
        state = {}
        for key in expected_state:
            t = tensors[f"state.{key}"]
            want_dtype, want_shape = (torch.int64, shape[:-1]) if key == "step" else (value.dtype, shape)
            if t.dtype != want_dtype or tuple(t.shape) != want_shape:
                raise ValueError(
                    f"{where}: state {key!r} is {_describe(t)}, expected dtype {want_dtype} "
                    f"and shape {tuple(want_shape)}"
                )
            state[key] = t.contiguous()
        return cls(shard_id, kind, value.contiguous(), optimizer, state, version, init)

    def _require(self, kind: str, instead: str) -> None:
        if self.kind != kind:
            raise ValueError(f"shard {self.shard_id!r} is {self.kind}; use {instead}() instead")

    def __repr__(self) -> str:
        return (
            f"Shard({self.shard_id!r}, {self.kind}, shape={list(self.value.shape)}, "
            f"version={self.version}, optimizer={self.optimizer.name})"
        )


def _check_shard_id(shard_id: Any) -> None:
    if not isinstance(shard_id, str) or not shard_id:
        raise ValueError(f"shard id must be a non-empty str, got {shard_id!r}")


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {x.dtype} and shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"
