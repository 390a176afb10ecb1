"""``ShardedCheckpoint``: the Trainer's state through :class:`trainmesh.checkpoint.CheckpointManager`.

Every process writes its own shards (torch.distributed.checkpoint), asynchronously by default;
a checkpoint counts only once its completion marker (with checksums) is written and it is
renamed into place, so a crash mid-save never looks complete. An async save is committed at the
end of the step after it at the latest (``commit_within_steps=1``: each rank waits there for its
own write, which overlapped that step), earlier when the writes are done, so a crash loses at most
one save interval. A save that fails to write (a full disk) is reported with the path and the free
space, training continues and the previous checkpoint is kept. ``fit(resume=True)`` continues
from the latest complete checkpoint (a damaged one is skipped with a warning), on any number
of processes, ZeRO stage or mesh, at the exact data position (mid-epoch included). When
checkpoints exist and none is valid, it stops with an error listing them instead of training
from step 0; ``fit(..., on_invalid_checkpoint="start_over")`` starts over explicitly.

A model with frozen parameters (a LoRA fine-tune's base) is saved without them unless
``save_frozen=True``, as peft saves adapters only: the checkpoint holds the trainable tensors,
their optimizer state and the rest of the run's state, and a resume expects the base built from
the same weights as the first start built it (``weights=`` or ``from_pretrained``).
"""

from __future__ import annotations

import os
from typing import Any

from .callbacks import Callback


class ShardedCheckpoint(Callback):
    """Save every ``every_n_steps`` steps and at each epoch end; keep the last ``keep_last`` and
    the best by ``keep_best=("val_loss", "min")``.

    >>> ckpt = ShardedCheckpoint("runs/exp1/ckpt", every_n_steps=500)   # doctest: +SKIP
    >>> trainer = tm.Trainer(model, opt, loss_fn, callbacks=[ckpt]); trainer.fit(data, resume=True)  # doctest: +SKIP

    ``save_frozen=False`` leaves frozen parameters (``requires_grad=False``) out; True saves the
    whole model (DeepSpeed's ``exclude_frozen_parameters``, the other way round).
    ``commit_within_steps``: see :class:`~trainmesh.checkpoint.CheckpointManager` (None lets a slow
    write run on in the background for longer, and a crash then may lose more than an interval).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike,
        *,
        every_n_steps: int | None = None,
        keep_last: int = 3,
        keep_best: tuple[str, str] | None = None,
        async_save: bool = True,
        save_frozen: bool = False,
        commit_within_steps: int | None = 1,
    ) -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be a positive int or None. Received: every_n_steps={every_n_steps!r}")
        self.dirpath = os.fspath(dirpath)
        self.every_n_steps = every_n_steps
        if not isinstance(save_frozen, bool):
            raise TypeError(f"save_frozen must be a bool. Received: save_frozen={save_frozen!r}")
        self.options = dict(
            keep_last=keep_last,
            keep_best=keep_best,
            async_save=async_save,
            save_frozen=save_frozen,
            commit_within_steps=commit_within_steps,
        )
        self.manager = None
        self.rejected: tuple[tuple[str, str], ...] = ()  # what the last resume() rejected: (path, why)

    def _ensure_manager(self):
        if self.manager is None:  # collective (it makes a process group): every process gets here
            from trainmesh.checkpoint import CheckpointManager

            self.manager = CheckpointManager(self.dirpath, **self.options)
        return self.manager

    def state(self, *, weights_only: bool = False) -> dict[str, Any]:
        trainer = self.trainer
        state: dict[str, Any] = {
            "model": trainer.model,
            "optimizer": trainer.optimizer,
            "scaler": trainer.precision.scaler,
        }
        if weights_only:
            return state
        sampler = trainer._steps.sampler if trainer._steps is not None else None
        state.update(scheduler=trainer.scheduler, data=sampler, trainer=trainer.metadata())
        if trainer.communication.compressor is not None:  # error-feedback residuals, per rank
            state["compression"] = trainer.communication
        return state

    def on_train_begin(self, logs=None) -> None:
        manager = self._ensure_manager()
        self._drop_rider()  # one left by a fit that raised
        if manager.async_save:
            # The commit check rides on the step's own loss all-reduce (when the Trainer makes one).
            from .loss_tracking import add_rider

            self._rider = manager.commit_rider()
            add_rider(self._rider)

    def on_train_batch_end(self, step: int, logs=None) -> None:
        # The last step of an epoch is saved once, by on_epoch_end, with the epoch counted as done:
        # a second save of the same step collided with it, and resuming from this one (the data
        # already in the next epoch, the loop's epoch not) retrained the whole epoch (issue 48).
        if (
            self.every_n_steps
            and self.trainer.global_step % self.every_n_steps == 0
            and not self.trainer.epoch_batches_done()
        ):
            self.manager.save(self.trainer.global_step, self.state())
        else:
            self.manager.poll()

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        self.manager.save(self.trainer.global_step, self.state(), metrics=dict(logs or {}))

    def on_train_end(self, logs=None) -> None:
        self._drop_rider()
        if self.manager is not None:
            self.manager.wait()  # the last async save is sealed before fit returns

    def _drop_rider(self) -> None:
        if getattr(self, "_rider", None) is not None:
            from .loss_tracking import remove_rider

            remove_rider(self._rider)
            self._rider = None

    def resume(self, on_invalid: str = "raise") -> bool:
        """Load the newest valid checkpoint into the trainer; False when there is none to load.

        When checkpoints exist and none is valid it raises
        :class:`~trainmesh.checkpoint.NoValidCheckpointError` on every process (listing each one and
        why), unless ``on_invalid="start_over"``: then the rejected ones are renamed ``*.rejected``
        and it returns False. Collective.
        """
        from trainmesh.checkpoint.survey import START_OVER, NoValidCheckpointError, check_on_invalid

        check_on_invalid(on_invalid)
        manager = self._ensure_manager()
        found = manager.survey()  # rank 0's verdict, on every process
        self.rejected = found.rejected
        if found.chosen is None:
            if found.rejected and on_invalid != START_OVER:
                raise NoValidCheckpointError(self.dirpath, found.rejected)
            manager.set_aside([path for path, _ in found.rejected])
            return False
        meta = manager.load(found.chosen, self.state())
        self.trainer.restore_metadata(meta["trainer"])
        return True

    def rollback(self) -> bool:
        """Weights, optimizer and scaler from the latest checkpoint; data position and counters go on."""
        return self._ensure_manager().load("latest", self.state(weights_only=True)) is not None
