"""One checkpoint directory shared by every replica group, written by one group per step.

torchft keeps nothing on disk: with every group lost, a restarted group would start at step 0.
So the groups keep the Trainer's usual checkpoints (``ShardedCheckpoint`` or ``ModelCheckpoint``) in
one directory they all see, and ``fit(resume=True)`` in a (re)started group loads the newest valid one
with the Trainer's own trust rules (a damaged or untrusted checkpoint is refused by name; with
checkpoints present and none valid, it raises instead of starting over).

Who writes: at each committed step, the group whose rank in that step's quorum is 0. The Lighthouse
orders a quorum's members by replica id, and every member sees the same quorum, so exactly one group
writes a given step, with no extra message: two groups never write the same directory. The other
groups' checkpoint callbacks are skipped for that step (their training state is the writer's, bit
for bit, so nothing is lost by not writing it twice). A group that stops being the writer (a group
with a lower id rejoined) seals its own save in flight at once, so the new writer's clean-up of
unfinished saves never meets it.

After a resume, torchft's step counter is set to the Trainer's: a group that resumed from an older
checkpoint than the live groups' step heals from them, and groups that all resumed from the same
checkpoint agree on the step without healing.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

__all__ = ["SharedCheckpoints"]

_HOOKS = ("on_train_batch_end", "on_epoch_end")


def _checkpoint_callbacks(trainer: Any) -> list[Any]:
    # the Trainer's own checkpoint callbacks (imported here: trainmesh.ft is imported by the trainer)
    from trainmesh.trainer.callbacks import ModelCheckpoint
    from trainmesh.trainer.sharded_checkpoint import ShardedCheckpoint

    return [cb for cb in trainer.callbacks if isinstance(cb, (ModelCheckpoint, ShardedCheckpoint))]


class SharedCheckpoints:
    """Gates the Trainer's checkpoint callbacks to the quorum's rank-0 group while a fault-tolerant fit runs."""

    def __init__(self, trainer: Any, replica_group: int):
        self.trainer, self.replica_group = trainer, replica_group
        self.callbacks = _checkpoint_callbacks(trainer)
        self.writer = False  # this group writes the current step's checkpoint
        self.resumed_step = trainer.global_step  # > 0: fit(resume=True) loaded a checkpoint
        for cb in self.callbacks:
            for hook in _HOOKS:
                # an instance attribute shadows the method (as LambdaCallback does); removed in close()
                setattr(cb, hook, self._gated(cb, getattr(type(cb), hook).__get__(cb)))

    def _gated(self, cb: Any, hook: Any):
        def run(*args: Any, **kwargs: Any) -> None:
            if self.writer:
                hook(*args, **kwargs)
            elif getattr(cb, "manager", None) is not None:
                cb.manager.wait()  # a save this group started while it was the writer: sealed now

        return run

    def set_writer(self, quorum_rank: int | None) -> None:
        self.writer = quorum_rank == 0

    def fresh_start_notice(self, step: int, healed: bool) -> None:
        """Said once, at the first quorum: a group that neither resumed nor healed starts at step 0, and
        says so (with a warning if the checkpoint directory is not empty: ``fit(resume=True)`` was
        probably meant)."""
        if healed or step > 0 or self.resumed_step > 0:
            return
        print(
            f"[trainmesh] replica group {self.replica_group}: no live peer ahead and no checkpoint loaded; "
            "starting at step 0",
            file=sys.stderr,
            flush=True,
        )
        for cb in self.callbacks:
            if os.path.isdir(cb.dirpath) and os.listdir(cb.dirpath):
                warnings.warn(
                    f"replica group {self.replica_group} starts at step 0 with no live peer ahead while "
                    f"{cb.dirpath} holds checkpoints: fit(resume=True) continues from the newest valid one",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def close(self) -> None:
        for cb in self.callbacks:
            for hook in _HOOKS:
                cb.__dict__.pop(hook, None)
