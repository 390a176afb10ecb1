"""``History``: what ``fit`` returns, Keras-style, plus the per-step records."""

from __future__ import annotations

from typing import Any


class History:
    """``history.history["loss"]`` is one value per epoch; ``history.steps`` one dict per logged step.

    >>> h = History(); h.record_epoch(0, {"loss": 1.0}); h.history["loss"]
    [1.0]
    """

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []
        self.steps: list[dict[str, Any]] = []

    def record_epoch(self, epoch: int, logs: dict[str, float]) -> None:
        self.epoch.append(epoch)
        for key, value in logs.items():
            self.history.setdefault(key, []).append(value)

    def record_step(self, record: dict[str, Any]) -> None:
        self.steps.append(dict(record))

    def last_epoch(self) -> dict[str, float]:
        return {key: values[-1] for key, values in self.history.items() if values}

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "epoch": self.epoch, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state.get("history", {}).items()}
        self.epoch = list(state.get("epoch", []))
        self.steps = list(state.get("steps", []))
