"""Parameter server: parameters sharded over server processes, workers pull and push over
ZeroMQ. See docs/parameter_server.md for the design.

Names are exported lazily (PEP 562), so ``import trainmesh`` / ``import trainmesh.ps`` stays
free of pyzmq and of the server machinery until one of them is used.

>>> import trainmesh as tm
>>> strategy = tm.ParameterServerStrategy(num_servers=2, mode="sync")   # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PSEmbedding": ".embedding",
    "ParameterServerStrategy": ".strategy",
    "PSDistribution": ".strategy",
    "PSOptimizer": ".worker_optimizer",
    "PSClient": ".client",
    "LocalCluster": ".cluster",
    "PSError": ".errors",
    "PSTimeoutError": ".errors",
    "PSAuthError": ".errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainmesh.ps' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
