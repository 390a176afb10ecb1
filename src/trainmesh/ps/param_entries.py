"""What a parameter on the servers is: its consistency mode (``"sync"``, ``"ssp"`` with a
staleness bound, ``"async"``) and the ``init`` entry a worker sends for it, a dense value or a
sparse table whose rows the servers draw. ``PSClient.init`` checks and completes entries
(``normalize_entry``); ``ParameterServerStrategy`` and ``PSEmbedding`` build them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

if TYPE_CHECKING:
    from .embedding import PSEmbedding
    from .strategy import ParameterServerStrategy

MODES = ("sync", "ssp", "async")


def parse_mode(value: Any, staleness: int | None) -> tuple[str, int | None]:
    """``"sync"`` / ``"async"`` / ``"ssp"`` / ``"ssp:K"`` -> (mode, staleness)."""
    if isinstance(value, str) and value.startswith("ssp:"):
        value, staleness = "ssp", _parse_staleness(value[4:], value)
    if value not in MODES:
        raise ValueError(f"mode must be one of {MODES} (or 'ssp:K'). Received: mode={value!r}")
    if value == "ssp":
        if staleness is None:
            raise ValueError(
                "mode='ssp' needs a staleness bound: staleness=K or mode='ssp:K'. Received: staleness=None"
            )
        return value, _parse_staleness(staleness, staleness)
    return value, (0 if value == "sync" else None)


def _parse_staleness(raw: Any, shown: Any) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = -1
    if isinstance(raw, bool) or value < 0 or (isinstance(raw, float) and raw != value):
        raise ValueError(f"staleness must be an int >= 0. Received: {shown!r}")
    return value


def normalize_entry(
    entry: Mapping[str, Any], optimizer: dict, mode: str, staleness: int | None, rows_per_shard: int, seed: int
) -> tuple[dict, torch.Tensor | None]:
    """The JSON spec of one init entry, and its dense value (None for tables)."""
    name, kind = entry.get("name"), entry.get("kind", "dense")
    if not isinstance(name, str) or not name:
        raise ValueError(f"init entry needs a non-empty str 'name', got {entry!r:.200}")
    mode = entry.get("mode") or mode
    staleness = entry.get("staleness", staleness) if entry.get("mode") else staleness
    if mode not in MODES:
        raise ValueError(f"init {name!r}: mode must be one of {MODES}, got {mode!r}")
    if mode == "sync":
        staleness = 0
    elif mode == "async":
        staleness = None
    elif not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        raise ValueError(f"init {name!r}: mode 'ssp' needs an int staleness >= 0, got {staleness!r}")
    spec = {
        "name": name,
        "kind": kind,
        "optimizer": dict(entry.get("optimizer") or optimizer),
        "mode": mode,
        "staleness": staleness,
    }
    if kind == "dense":
        value = entry.get("value")
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(f"init {name!r}: a dense entry needs a floating-point tensor 'value', got {value!r:.80}")
        spec["shape"] = list(value.shape)
        return spec, value.detach().to("cpu", torch.float32)
    if kind != "sparse":
        raise ValueError(f"init {name!r}: kind must be 'dense' or 'sparse', got {kind!r}")
    shape = entry.get("shape")
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)
    ):
        raise ValueError(f"init {name!r}: a sparse table needs shape (rows, dim) of ints >= 1, got {shape!r}")
    spec.update(
        shape=list(shape),
        init=table_init(entry.get("init"), int(entry.get("seed", seed))),
        rows_per_shard=rows_per_shard,
    )
    return spec, None


def table_init(init: Any, seed: int) -> dict:
    """Accept ``{"std": s}`` / ``{"zeros": True}`` shorthands for the shard's ``{"kind": ...}`` form."""
    if init is None or (isinstance(init, dict) and init.get("zeros")):
        return {"kind": "zeros"}
    if not isinstance(init, dict):
        raise TypeError(f"table init must be a dict like {{'std': 0.01}} or {{'zeros': True}}, got {init!r}")
    if "kind" in init:
        return {"seed": seed, **init} if init["kind"] == "normal" else dict(init)
    return {"kind": "normal", "std": init.get("std", 0.01), "seed": seed}


def dense_param(name: str, value: torch.Tensor, optimizer: dict, mode: str, staleness: int | None) -> dict:
    """The ``init`` entry of a dense parameter."""
    return {
        "name": name,
        "kind": "dense",
        "shape": list(value.shape),
        "value": value.float().contiguous(),
        "optimizer": optimizer,
        "mode": mode,
        "staleness": staleness,
    }


def table_param(table: PSEmbedding, strategy: ParameterServerStrategy | None) -> dict:
    """The ``init`` entry of an embedding table (rows are drawn on the servers)."""
    if table.mode is not None:
        mode, staleness = parse_mode(table.mode, table.staleness)
    elif strategy is not None:
        mode, staleness = strategy.mode_of(table.name)
    else:
        mode, staleness = "async", None
    init = {"std": table.init_std} if table.init_std > 0 else {"zeros": True}
    return {
        "name": table.name,
        "kind": "sparse",
        "shape": [table.num_embeddings, table.embedding_dim],
        "optimizer": table.server_optimizer,
        "init": init,
        "mode": mode,
        "staleness": staleness,
    }


def register_table(client: Any, table: PSEmbedding) -> None:
    """Create ``table`` on the servers of an explicitly given client (no strategy)."""
    client.init([table_param(table, None)])
