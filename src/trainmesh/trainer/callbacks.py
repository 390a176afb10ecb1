"""Keras-style callbacks: hooks the Trainer calls on every rank, in the same order.

Logs handed to epoch hooks are already reduced over all ranks, so a callback that decides
from them (EarlyStopping) decides the same on every rank. Callbacks reach the run through
``self.trainer`` (Keras's ``self.model``): ``request_stop``, ``save_checkpoint``,
``unwrapped_model``, ``is_main_process``.

>>> class PrintLoss(Callback):
...     def on_epoch_end(self, epoch, logs=None):
...         if self.trainer.is_main_process:
...             print(epoch, logs["loss"])
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable, Dict, Iterable, Optional

import torch

__all__ = ["Callback", "CallbackList", "EarlyStopping", "LambdaCallback", "ModelCheckpoint"]

Logs = Optional[Dict[str, Any]]


class Callback:
    """Base class: every hook is a no-op; override the ones you need.

    >>> class CountEpochs(Callback):
    ...     def on_train_begin(self, logs=None):
    ...         self.epochs = 0
    ...     def on_epoch_end(self, epoch, logs=None):
    ...         self.epochs += 1
    """

    trainer = None  # set by the Trainer (through CallbackList) before on_train_begin

    def set_trainer(self, trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, logs: Logs = None) -> None: ...
    def on_train_end(self, logs: Logs = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None: ...
    def on_train_batch_begin(self, step: int, logs: Logs = None) -> None: ...
    def on_train_batch_end(self, step: int, logs: Logs = None) -> None: ...
    def on_test_begin(self, logs: Logs = None) -> None: ...
    def on_test_end(self, logs: Logs = None) -> None: ...
    def on_test_batch_begin(self, step: int, logs: Logs = None) -> None: ...
    def on_test_batch_end(self, step: int, logs: Logs = None) -> None: ...
    def on_predict_begin(self, logs: Logs = None) -> None: ...
    def on_predict_end(self, logs: Logs = None) -> None: ...

    def state_dict(self) -> dict:
        """What a checkpoint must carry for this callback to resume where it was (default: nothing)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; called by ``fit(resume=...)`` after ``on_train_begin``."""


# Hook names, and whether the hook takes an index (epoch or step) before ``logs``.
HOOKS: dict[str, bool] = {
    "on_train_begin": False,
    "on_train_end": False,
    "on_epoch_begin": True,
    "on_epoch_end": True,
    "on_train_batch_begin": True,
    "on_train_batch_end": True,
    "on_test_begin": False,
    "on_test_end": False,
    "on_test_batch_begin": True,
    "on_test_batch_end": True,
    "on_predict_begin": False,
    "on_predict_end": False,
}


class CallbackList(Callback):
    """Calls each hook on each callback, in list order, and gives them all the trainer.

    >>> seen = []
    >>> cbs = CallbackList([LambdaCallback(on_epoch_end=lambda e, logs: seen.append(e))], trainer=None)
    >>> cbs.on_epoch_end(0, {"loss": 1.0})
    >>> seen
    [0]
    """

    def __init__(self, callbacks: Iterable[Callback] | None = None, trainer=None) -> None:
        self.callbacks: list[Callback] = []
        for callback in callbacks or ():
            self.append(callback)
        self.set_trainer(trainer)

    def append(self, callback: Callback) -> None:
        if not isinstance(callback, Callback):
            raise TypeError(f"Callbacks must be trainmesh Callback instances. Received: callback={callback!r}")
        self.callbacks.append(callback)
        if self.trainer is not None:
            callback.set_trainer(self.trainer)

    def set_trainer(self, trainer) -> None:
        self.trainer = trainer
        for callback in self.callbacks:
            callback.set_trainer(trainer)

    def __iter__(self):
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def _fan_out(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def on_train_begin(self, logs=None):
        self._fan_out("on_train_begin", logs)

    def on_train_end(self, logs=None):
        self._fan_out("on_train_end", logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._fan_out("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._fan_out("on_epoch_end", epoch, logs)

    def on_train_batch_begin(self, step, logs=None):
        self._fan_out("on_train_batch_begin", step, logs)

    def on_train_batch_end(self, step, logs=None):
        self._fan_out("on_train_batch_end", step, logs)

    def on_test_begin(self, logs=None):
        self._fan_out("on_test_begin", logs)

    def on_test_end(self, logs=None):
        self._fan_out("on_test_end", logs)

    def on_test_batch_begin(self, step, logs=None):
        self._fan_out("on_test_batch_begin", step, logs)

    def on_test_batch_end(self, step, logs=None):
        self._fan_out("on_test_batch_end", step, logs)

    def on_predict_begin(self, logs=None):
        self._fan_out("on_predict_begin", logs)

    def on_predict_end(self, logs=None):
        self._fan_out("on_predict_end", logs)


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


def _is_main(trainer) -> bool:
    flag = getattr(trainer, "is_main_process", True)
    return bool(flag() if callable(flag) else flag)


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


class LambdaCallback(Callback):
    """A callback from plain functions, one per hook (Keras ``LambdaCallback``).

    Epoch and batch hooks receive ``(index, logs)``; the others ``(logs)``.

    >>> log = LambdaCallback(on_epoch_end=lambda epoch, logs: None)
    """

    def __init__(self, **hooks: Callable[..., Any] | None) -> None:
        for hook, fn in hooks.items():
            if hook not in HOOKS:
                raise TypeError(f"LambdaCallback takes only hook names {sorted(HOOKS)}. Received: {hook}=...")
            if fn is not None and not callable(fn):
                raise TypeError(f"LambdaCallback hooks must be callables. Received: {hook}={fn!r}")
            if fn is not None:
                # An instance attribute shadows the no-op method of the same name.
                setattr(self, hook, _as_hook(fn, takes_index=HOOKS[hook]))


def _as_hook(fn: Callable[..., Any], *, takes_index: bool) -> Callable[..., None]:
    if takes_index:
        return lambda index, logs=None: fn(index, logs)
    return lambda logs=None: fn(logs)
