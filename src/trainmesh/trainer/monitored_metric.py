"""The metric a callback watches: which way is better (``mode``), and its value in the epoch's logs.

It exists apart from the callbacks because ``EarlyStopping`` and ``ModelCheckpoint`` read a
monitored metric the same way, with the same errors and warning.
"""

from __future__ import annotations

import warnings


def _resolve_mode(mode: str, monitor: str) -> str:
    """``"min"`` or ``"max"``; ``"auto"`` reads the name: losses go down, accuracies up."""
    if mode in ("min", "max"):
        return mode
    if mode != "auto":
        raise ValueError(f"mode must be 'auto', 'min' or 'max'. Received: mode={mode!r}")
    name = monitor.removeprefix("val_")
    if "loss" in name:
        return "min"
    if "acc" in name:
        return "max"
    # Keras 3 also refuses to guess: a wrong guess silently stops at the worst epoch.
    raise ValueError(
        f"mode='auto' cannot tell whether {monitor!r} should go down or up; pass mode='min' or mode='max'. "
        f"Received: monitor={monitor!r}"
    )


def _monitored_value(owner: str, monitor: str, logs) -> float | None:
    logs = logs or {}
    value = logs.get(monitor)
    if value is None:
        # A warning, as in Keras: e.g. val_loss is absent when fit() got no eval_data.
        warnings.warn(
            f"{owner} is conditioned on {monitor!r}, which is not in the logs. Available: {', '.join(logs)}",
            stacklevel=3,
        )
        return None
    return float(value)
