"""``Callback``: the base class of every callback, with every hook a no-op, and ``HOOKS``, the hook
names and whether each takes an index.

It exists apart from ``callbacks.py`` so that the callbacks in their own modules
(``early_stopping.py``, ``model_checkpoint.py``) and ``callbacks.py``, which re-exports them, all
import the base without importing each other. The module docstring of ``callbacks.py`` says what
a callback sees.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

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

__all__ = ["Callback", "HOOKS", "Logs"]
