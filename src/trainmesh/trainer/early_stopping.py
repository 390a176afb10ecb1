"""``EarlyStopping``: stop training when a monitored metric stops improving, and optionally restore
the best epoch's weights.

It exists apart from ``callbacks.py`` because it carries its own state (the count, the best value,
a CPU copy of the best weights) and the copy-and-restore of each rank's local shards.
"""

from __future__ import annotations

import math

import torch

from .callback_base import Callback
from .monitored_metric import _monitored_value, _resolve_mode


class EarlyStopping(Callback):
    """Stop training when ``monitor`` stops improving (Keras semantics).

    An epoch improves when it beats the best by more than ``min_delta``. After ``patience``
    epochs in a row without improvement, every rank calls ``trainer.request_stop``. With
    ``baseline``, an improvement resets the count only if it also beats the baseline (as in
    Keras, an epoch that improves on the best never stops the run). Never stops at epoch 0. ``restore_best_weights`` keeps a CPU copy of the
    model's state at the best epoch and loads it back when training ends (each rank its
    own shards, so DTensor models need no collective).

    >>> stop = EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0,
        patience: int = 0,
        mode: str = "auto",
        restore_best_weights: bool = False,
        baseline: float | None = None,
    ) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"patience must be a non-negative integer. Received: patience={patience!r}")
        self.monitor = monitor
        self.mode = _resolve_mode(mode, monitor)
        self.min_delta = abs(float(min_delta))
        self.patience = patience
        self.restore_best_weights = restore_best_weights
        self.baseline = baseline
        self.on_train_begin()

    def _improves(self, value: float, reference: float | None) -> bool:
        if reference is None:
            return True
        # The gain must exceed min_delta: below the reference by more than it (min), or above (max).
        if self.mode == "min":
            return value + self.min_delta < reference
        return value - self.min_delta > reference

    def on_train_begin(self, logs=None) -> None:
        # Reset so that one instance can serve several fit() calls.
        self.wait = 0
        self.stopped_epoch: int | None = None
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.best_weights: dict[str, torch.Tensor] | None = None

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        current = _monitored_value("EarlyStopping", self.monitor, logs)
        if current is None:
            return
        self.wait += 1
        if self._improves(current, self.best) and not math.isnan(current):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = _snapshot(self.trainer.unwrapped_model)
            if self.baseline is None or self._improves(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.trainer.request_stop(
                f"EarlyStopping: {self.monitor} did not improve for {self.wait} epoch(s); "
                f"best {self.best!r} at epoch {self.best_epoch}"
            )

    def state_dict(self) -> dict:
        # The best weights themselves are not carried (they can be a whole model); after a resume,
        # restore_best_weights restores the best epoch seen since the resume.
        return {"wait": self.wait, "best": self.best, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.wait, self.best, self.best_epoch = state["wait"], state["best"], state["best_epoch"]

    def on_train_end(self, logs=None) -> None:
        if self.restore_best_weights and self.best_weights is not None:
            _restore(self.trainer.unwrapped_model, self.best_weights)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # A copy on the CPU: the model keeps training after the best epoch, and a second full
    # copy on the accelerator would cost memory the run needs.
    return {name: _local(t).detach().to("cpu", copy=True) for name, t in model.state_dict().items()}


@torch.no_grad()
def _restore(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    # In place into each tensor's local part (state_dict() tensors share storage with the
    # model): works alike for plain tensors and DTensor shards.
    current = model.state_dict()
    if current.keys() != snapshot.keys():
        raise RuntimeError(
            "EarlyStopping cannot restore the best weights: the model's state keys changed. "
            f"Missing: {sorted(snapshot.keys() - current.keys())}, new: {sorted(current.keys() - snapshot.keys())}"
        )
    for name, tensor in current.items():
        _local(tensor).copy_(snapshot[name])


__all__ = ["EarlyStopping"]
