"""``CommitRider``: the question ``CheckpointManager.poll`` asks ("is every rank's write of the save
in flight done?"), carried on the step's own all-reduce instead of one of its own.

It exists apart from ``manager.py`` because it is the Trainer's side of the commit
(``trainmesh.trainer.loss_tracking.add_rider``), not part of saving or loading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from .async_save import PendingSave

if TYPE_CHECKING:
    from .manager import CheckpointManager


class CommitRider:
    """Asks, within another collective, whether every rank's write of the save in flight is done."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        self._asked: PendingSave | None = None

    def local_value(self) -> float:
        self._asked = self.manager._pending
        return 1.0 if self._asked is not None and self._asked.ask(self.manager.commit_within_steps) else 0.0

    def receive(self, total: float) -> None:
        if self._asked is None:
            return
        world = dist.get_world_size() if self.manager._distributed else 1
        if total >= world and self._asked is self.manager._pending:
            # Committed here, inside the step, as soon as every rank heard that every write is done
            # (every rank is at this same point): not at the step's end, so a crash during the step
            # no longer costs it a checkpoint (with the step after a save: a loss of interval + 1).
            self.manager.wait()
        else:
            self.manager._heard = (self._asked, total >= world)


__all__ = ["CommitRider"]
