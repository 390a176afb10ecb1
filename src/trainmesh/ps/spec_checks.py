"""What a server accepts as a parameter spec, and the staleness bound it reads from one.

An init is logged before it is applied and replayed on every restart, so a spec the server could
not serve (an unknown mode or optimizer, a table without its shape) must be refused before the
write-ahead log holds it, naming what is wrong. Clients build the specs (param_entries.py); these
are the server's own checks, apart from ``ServerState`` (server_state.py) because they read the
spec alone, never the state.
"""

from __future__ import annotations

import math
from typing import Any

from .optimizers import make_optimizer
from .shard import Shard


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_spec(spec: dict) -> None:
    """Refuse a parameter spec the server could not serve, before it reaches the log."""
    name = spec["name"]
    if spec.get("mode") not in ("sync", "ssp", "async"):
        raise ValueError(f"parameter {name!r}: mode must be sync, ssp or async, got {spec.get('mode')!r}")
    staleness = spec.get("staleness")
    if spec["mode"] != "async" and not (
        isinstance(staleness, int) and not isinstance(staleness, bool) and staleness >= 0
    ):
        raise ValueError(f"parameter {name!r}: mode {spec['mode']!r} needs an int staleness >= 0, got {staleness!r}")
    make_optimizer(spec.get("optimizer"))  # raises naming what is wrong
    shape = spec.get("shape")
    if spec.get("kind") == "sparse":
        if not (isinstance(shape, list) and len(shape) == 2 and all(_positive_int(d) for d in shape)):
            raise ValueError(f"table {name!r}: shape must be [rows, dim] of ints >= 1, got {shape!r}")
        if not _positive_int(spec.get("rows_per_shard")) or not isinstance(spec.get("init"), dict):
            raise ValueError(
                f"table {name!r}: needs an int rows_per_shard >= 1 and an init dict, got "
                f"{spec.get('rows_per_shard')!r}, {spec.get('init')!r}"
            )
        Shard.sparse(f"{name}#0", 1, shape[1], spec["optimizer"], spec["init"])  # checks the init spec
    elif spec.get("kind") != "dense" or not isinstance(shape, list):
        raise ValueError(f"parameter {name!r}: kind must be 'dense' (with a shape list) or 'sparse', got {spec!r:.200}")


def _staleness(spec: dict) -> float:
    return math.inf if spec["mode"] == "async" else float(spec["staleness"])
