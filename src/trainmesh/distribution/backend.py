"""Where a description is handed over to be applied: the engine registers itself here.

The front end describes (meshes, layouts, distributions) and never imports the engine
(``trainmesh._torch``); the engine imports the front end to read descriptions. The package
root connects the two at import (``trainmesh/__init__.py``), so ``distribute_model`` still
works as Keras users expect, without the two halves importing each other.
"""

from __future__ import annotations

from typing import Any, Callable

_ENGINE: dict[str, Callable[..., Any]] = {}


def register_engine(**functions: Callable[..., Any]) -> None:
    """``apply_model(model, distribution, **options)``, ``prepare_optimizer(optimizer, distribution, zero_stage=None)``,
    ``global_mean(value)``: the engine's entry points."""
    _ENGINE.update(functions)


def engine(name: str) -> Callable[..., Any]:
    function = _ENGINE.get(name)
    if function is None:
        raise RuntimeError(
            f"No engine is registered for {name!r}: import trainmesh (the package), which registers torch's."
        )
    return function
