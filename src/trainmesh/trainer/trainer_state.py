"""The Trainer's state: what a checkpoint holds, saving and loading it, resuming a run from one, and
rolling back to the last one after a non-finite loss (``nonfinite_loss="rollback"``).

A mixin of :class:`~trainmesh.trainer.Trainer`: it reads the Trainer's model, optimizer, precision,
scheduler, data position (``_steps``), callbacks, history and counters.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from trainmesh import runtime
from trainmesh._torch.state import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)

from .callbacks import ModelCheckpoint
from .sharded_checkpoint import ShardedCheckpoint


class TrainerState:
    def state_dict(self) -> dict[str, Any]:
        """Full state, gathered onto the main process (the others get empty model/optimizer dicts).

        Every process must call it: sharded parameters are gathered with collectives.
        """
        return {
            "model": full_model_state(self.model),
            "optimizer": full_optimizer_state(self.model, self.optimizer),
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            **self.metadata(),
            # (seed, epoch, cursor): a mid-epoch checkpoint resumes at the next unseen sample.
            "data": self._steps.state_dict() if self._steps is not None else None,
            "compression": self.communication.gathered_state(),  # every rank's residuals (collective)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("precision", self.config.precision) != self.config.precision:
            raise ValueError(f"The checkpoint was trained with precision {state['precision']!r}; this Trainer "
                             f"uses {self.config.precision!r}.")
        self._load_weights(state)
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])
        if self._steps is not None:
            self._steps.load_state_dict(state.get("data"))
        self.communication.load_gathered_state(state.get("compression"))
        self.restore_metadata(state)

    def _load_weights(self, state: dict[str, Any]) -> None:
        """Model, optimizer and loss scaler from a full state (a resume, or a rollback)."""
        load_full_model_state(self.model, state["model"])
        load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        if self.precision.scaler is not None and state.get("scaler"):
            self.precision.scaler.load_state_dict(state["scaler"])

    def metadata(self) -> dict[str, Any]:
        """The loop's own small state (counters, history, callbacks), saved with every checkpoint."""
        config = {k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)
                  for k, v in vars(self.config).items()}  # for the record (plain values: JSON-safe)
        return {"global_step": self.global_step, "epoch": self.epoch, "precision": self.config.precision,
                "config": config, "history": self.history.state_dict(),
                "callbacks": [cb.state_dict() for cb in self.callbacks]}

    def restore_metadata(self, meta: dict[str, Any]) -> None:
        if meta.get("precision", self.config.precision) != self.config.precision:
            raise ValueError(f"The checkpoint was trained with precision {meta['precision']!r}; this Trainer "
                             f"uses {self.config.precision!r}.")
        self.global_step, self.epoch = int(meta["global_step"]), int(meta["epoch"])
        self.history.load_state_dict(meta.get("history", {}))
        saved = meta.get("callbacks") or []
        if len(saved) == len(self.callbacks):  # same callbacks in the same order: carry their state on
            for callback, callback_state in zip(self.callbacks, saved):
                if callback_state:
                    callback.load_state_dict(callback_state)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write the full state to ``path`` from the main process (atomically: a temp file, then rename)."""
        state = self.state_dict()
        if self.is_main_process:
            path = os.fspath(path)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.tmp"
            torch.save(state, tmp)
            os.replace(tmp, path)
        runtime.barrier()

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        self.load_state_dict(torch.load(os.fspath(path), map_location="cpu", weights_only=False))

    def _resume(self, resume: bool | str) -> None:
        sharded = [cb for cb in self.callbacks if isinstance(cb, ShardedCheckpoint)]
        if sharded and not isinstance(resume, (str, os.PathLike)):
            found = sharded[0].resume()
            if self.is_main_process:
                print(f"[trainmesh] resumed from {sharded[0].dirpath} at epoch {self.epoch}, step {self.global_step}"
                      if found else f"[trainmesh] no complete checkpoint in {sharded[0].dirpath}; starting fresh",
                      flush=True)
            return
        if isinstance(resume, (str, os.PathLike)):
            path = os.fspath(resume)
        else:
            checkpoints = [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]
            if not checkpoints:
                raise ValueError("fit(resume=True) needs a ModelCheckpoint or ShardedCheckpoint callback "
                                 "(or resume='path/to/last.pt').")
            path = checkpoints[0].last_path
        if os.path.exists(path):
            self.load_checkpoint(path)
            if self.is_main_process:
                print(f"[trainmesh] resumed from {path} at epoch {self.epoch}, step {self.global_step}", flush=True)
        elif self.is_main_process:
            print(f"[trainmesh] no checkpoint at {path}; starting fresh", flush=True)

    def _rollback(self) -> None:
        """Back to the last checkpoint's weights and optimizer state; the data position, step counter
        and history go on (re-reading the batches that diverged would likely diverge again)."""
        sharded = [cb for cb in self.callbacks if isinstance(cb, ShardedCheckpoint)]
        if sharded:
            if sharded[0].rollback():
                self.rollbacks += 1
            return
        checkpoints = [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]
        path = checkpoints[0].last_path if checkpoints else None
        if path is None or not os.path.exists(path):
            if self.is_main_process:
                print("[trainmesh] rollback requested but no checkpoint exists yet; the step is skipped",
                      file=sys.stderr, flush=True)
            return
        self._load_weights(torch.load(path, map_location="cpu", weights_only=False))
        self.rollbacks += 1
