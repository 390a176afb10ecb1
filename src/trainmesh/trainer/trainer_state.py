"""The Trainer's state: what a checkpoint holds, saving and loading it, resuming a run from one, and
rolling back to the last one after a non-finite loss (``nonfinite_loss="rollback"``).

A mixin of :class:`~trainmesh.trainer.Trainer`: it reads the Trainer's model, optimizer, precision,
scheduler, data position (``_steps``), callbacks, history and counters.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable

import torch.distributed as dist

from trainmesh import runtime
from trainmesh.checkpoint.single_file import (
    check_checkpoint_file,
    checksum_path,
    load_plain,
    previous_path,
    save_checkpoint_file,
    set_aside,
)
from trainmesh.checkpoint.survey import START_OVER, NoValidCheckpointError, Survey, survey_files
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

        ``"model"`` holds every parameter and persistent buffer under the unwrapped model's names, whole,
        as a one-process ``model.load_state_dict`` takes it: under ZeRO, tensor parallelism and a
        pipeline alike (every stage's, not only the main process's own). Every process must call it:
        sharded parameters are gathered with collectives.
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
            raise ValueError(
                f"The checkpoint was trained with precision {state['precision']!r}; this Trainer "
                f"uses {self.config.precision!r}."
            )
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

    def epoch_batches_done(self) -> bool:
        """Whether every step of the current epoch has run (its end-of-epoch work may not have yet)."""
        return self._steps is not None and self._steps.finished_epoch(self.epoch)

    def metadata(self) -> dict[str, Any]:
        """The loop's own small state (counters, history, callbacks), saved with every checkpoint."""
        config = {
            k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)
            for k, v in vars(self.config).items()
        }  # for the record (plain values: JSON-safe)
        return {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "precision": self.config.precision,
            "config": config,
            "history": self.history.state_dict(),
            "callbacks": [cb.state_dict() for cb in self.callbacks],
        }

    def restore_metadata(self, meta: dict[str, Any]) -> None:
        if meta.get("precision", self.config.precision) != self.config.precision:
            raise ValueError(
                f"The checkpoint was trained with precision {meta['precision']!r}; this Trainer "
                f"uses {self.config.precision!r}."
            )
        self.global_step, self.epoch = int(meta["global_step"]), int(meta["epoch"])
        self.history.load_state_dict(meta.get("history", {}))
        saved = meta.get("callbacks") or []
        if len(saved) == len(self.callbacks):  # same callbacks in the same order: carry their state on
            for callback, callback_state in zip(self.callbacks, saved):
                if callback_state:
                    callback.load_state_dict(callback_state)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write the full state to ``path`` from the main process: fsynced, with a ``.sha256`` checksum
        file, atomically, keeping the file it replaces as ``*.prev.pt`` (see
        :mod:`trainmesh.checkpoint.single_file`). Every process must call it."""
        state = self.state_dict()
        if self.is_main_process:
            save_checkpoint_file(state, path)
        runtime.barrier()

    def load_checkpoint(self, path: str | os.PathLike, *, verify: bool = True) -> None:
        """Load a file written by :meth:`save_checkpoint` (``torch.load(weights_only=True)``: it runs no
        code). With ``verify``, a file that fails its checksum raises; one without a checksum file loads
        with a warning."""
        path = os.fspath(path)
        if verify:
            problem = check_checkpoint_file(path)
            if problem is not None and os.path.exists(checksum_path(path)):
                raise ValueError(f"Checkpoint {path} is damaged: {problem}. Received: path={path!r}")
            if problem is not None:
                warnings.warn(f"Loading {path} unchecked: {problem}.", RuntimeWarning, stacklevel=2)
        self.load_state_dict(load_plain(path))

    def _resume(self, resume: bool | str, on_invalid: str = "raise") -> None:
        sharded = [cb for cb in self.callbacks if isinstance(cb, ShardedCheckpoint)]
        if sharded and not isinstance(resume, (str, os.PathLike)):
            resumed = sharded[0].resume(on_invalid)
            self._report_resume(sharded[0].dirpath, resumed, sharded[0].rejected)
            return
        if isinstance(resume, (str, os.PathLike)):
            location, candidates = os.fspath(resume), [os.fspath(resume)]
        else:
            checkpoints = [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]
            if not checkpoints:
                raise ValueError(
                    "fit(resume=True) needs a ModelCheckpoint or ShardedCheckpoint callback "
                    "(or resume='path/to/last.pt')."
                )
            location = checkpoints[0].dirpath
            candidates = [checkpoints[0].last_path, previous_path(checkpoints[0].last_path)]

        def decide() -> Survey:
            found = _survey_files(candidates, explicit=isinstance(resume, (str, os.PathLike)))
            if found.chosen is None and on_invalid == START_OVER:
                for path, _ in found.rejected:
                    set_aside(path)
            return found

        found = _rank0_decides(decide)
        if found.chosen is not None:
            self.load_checkpoint(found.chosen, verify=False)  # the main process checked it for everyone
            self._report_resume(found.chosen, True)
            return
        if found.rejected and on_invalid != START_OVER:
            raise NoValidCheckpointError(location, found.rejected)  # on every process alike
        self._report_resume(location, False, found.rejected)

    def _report_resume(self, location: str, resumed: bool, rejected=()) -> None:
        if not self.is_main_process:
            return
        if resumed:
            print(f"[trainmesh] resumed from {location} at epoch {self.epoch}, step {self.global_step}", flush=True)
        elif rejected:
            print(
                f"[trainmesh] no valid checkpoint in {location}; starting over from step 0 as "
                f"on_invalid_checkpoint={START_OVER!r} asks (the rejected ones are renamed *.rejected)",
                flush=True,
            )
        else:
            print(f"[trainmesh] no checkpoint in {location} yet; starting from step 0", flush=True)

    def _rollback(self) -> None:
        """Back to the last checkpoint's weights and optimizer state; the data position, step counter
        and history go on (re-reading the batches that diverged would likely diverge again)."""
        sharded = [cb for cb in self.callbacks if isinstance(cb, ShardedCheckpoint)]
        if sharded:
            if sharded[0].rollback():
                self.rollbacks += 1
            return
        checkpoints = [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]
        last = checkpoints[0].last_path if checkpoints else None
        found = _rank0_decides(lambda: _survey_files([last, previous_path(last)], explicit=False) if last else Survey())
        if found.chosen is None:
            if self.is_main_process:
                why = "; ".join(f"{path}: {problem}" for path, problem in found.rejected) or "none exists yet"
                print(
                    f"[trainmesh] rollback requested but no valid checkpoint ({why}); the step is skipped",
                    file=sys.stderr,
                    flush=True,
                )
            return
        self._load_weights(load_plain(found.chosen))
        self.rollbacks += 1


def _survey_files(candidates: list[str], *, explicit: bool) -> Survey:
    """``survey_files`` and its warnings; a path the user named may lack a checksum file (it may come
    from elsewhere): it is loaded, still with ``weights_only=True``, after a warning."""
    found = survey_files(candidates)
    if explicit and found.chosen is None and found.rejected and not os.path.exists(checksum_path(candidates[0])):
        warnings.warn(f"Loading {candidates[0]} unchecked: {found.rejected[0][1]}.", RuntimeWarning, stacklevel=3)
        return Survey(candidates[0])
    found.warn(stacklevel=4)
    return found


def _rank0_decides(decide: Callable[[], Any]) -> Any:
    """``decide()`` on the main process, handed to every process (its error raised on every one), so all
    of them resume from the same file or stop together, before any training collective."""
    value: Any = None
    if runtime.rank() == 0:
        try:
            value = decide()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every process
            value = exc
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    if isinstance(value, Exception):
        raise value
    return value
