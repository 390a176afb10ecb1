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

from typing import Any, Callable, Iterable

from .callback_base import HOOKS, Callback
from .early_stopping import EarlyStopping
from .model_checkpoint import ModelCheckpoint

__all__ = ["Callback", "CallbackList", "EarlyStopping", "LambdaCallback", "ModelCheckpoint"]


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
