"""``ModelCheckpoint``: save ``last.pt`` every epoch (and every n steps) and ``best.pt`` when a
monitored metric improves, through the Trainer's own ``save_checkpoint``.

It exists apart from ``callbacks.py`` because it is the single-file checkpoint callback, with its
own paths and state; ``ShardedCheckpoint`` (``sharded_checkpoint.py``) is the sharded one.
"""

from __future__ import annotations

import math
import os

from .callback_base import Callback
from .monitored_metric import _monitored_value, _resolve_mode


def _is_main(trainer) -> bool:
    flag = getattr(trainer, "is_main_process", True)
    return bool(flag() if callable(flag) else flag)


class ModelCheckpoint(Callback):
    """Save ``dirpath/last.pt`` every epoch (and every ``save_every_n_steps`` steps, mid-epoch
    included) and ``dirpath/best.pt`` when ``monitor`` improves.

    Every rank calls ``trainer.save_checkpoint(path)`` (gathering sharded state can need
    all of them); the Trainer writes on the main process: fsynced, atomically, with a
    ``last.pt.sha256`` checksum file, keeping the file it replaces as ``last.prev.pt``.
    ``fit(..., resume=True)`` picks up ``dirpath/last.pt``, or ``last.prev.pt`` (with a warning
    naming the problem) when ``last.pt`` fails its checksum; both are read with
    ``torch.load(weights_only=True)``. An improvement is any strict gain over the best so far.

    >>> ckpt = ModelCheckpoint("checkpoints", monitor="val_accuracy")
    >>> os.path.basename(ckpt.best_path)
    'best.pt'
    """

    def __init__(
        self,
        dirpath: str | os.PathLike,
        monitor: str = "val_loss",
        mode: str = "auto",
        save_last: bool = True,
        save_best: bool = True,
        save_every_n_steps: int | None = None,
    ) -> None:
        if save_every_n_steps is not None and (isinstance(save_every_n_steps, bool) or save_every_n_steps < 1):
            raise ValueError(f"save_every_n_steps must be a positive int or None. Received: {save_every_n_steps!r}")
        self.save_every_n_steps = save_every_n_steps
        self.dirpath = os.fspath(dirpath)
        self.monitor = monitor
        # Only a best-checkpoint needs a direction; last.pt alone must not demand a mode.
        self.mode = _resolve_mode(mode, monitor) if save_best else mode
        self.save_last = save_last
        self.save_best = save_best
        self.best: float | None = None
        self.best_epoch: int | None = None

    @property
    def last_path(self) -> str:
        return os.path.join(self.dirpath, "last.pt")

    @property
    def best_path(self) -> str:
        return os.path.join(self.dirpath, "best.pt")

    def on_train_begin(self, logs=None) -> None:
        if _is_main(self.trainer):
            os.makedirs(self.dirpath, exist_ok=True)

    def state_dict(self) -> dict:
        return {"best": self.best, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_epoch = state["best"], state["best_epoch"]

    def on_train_batch_end(self, step: int, logs=None) -> None:
        # Mid-epoch saves carry the data position, so a crash loses at most n steps.
        n = self.save_every_n_steps
        # (not at an epoch's last step: on_epoch_end saves that step once, with the epoch done)
        if n and self.save_last and self.trainer.global_step % n == 0 and not self.trainer.epoch_batches_done():
            self.trainer.save_checkpoint(self.last_path)

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        if self.save_last:
            self.trainer.save_checkpoint(self.last_path)
        if not self.save_best:
            return
        current = _monitored_value("ModelCheckpoint", self.monitor, logs)
        if current is None or math.isnan(current):
            return
        if self.best is None or (current < self.best if self.mode == "min" else current > self.best):
            self.best, self.best_epoch = current, epoch
            self.trainer.save_checkpoint(self.best_path)


__all__ = ["ModelCheckpoint"]
