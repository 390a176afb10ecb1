"""The sample log of the fault-tolerance jobs: which samples every process trained on, per step.

A job writes, per process, ``RESUME <attempt> <global step> [extra]`` once where an attempt
starts (after the auto-resume) and ``STEP <attempt> <epoch> <global step> <sample indices>``
after every step; each line reaches the disk before the step goes on (``fsync``), so a process
SIGKILLed right after a step still leaves it. The tests read these logs to show that every
sample was trained exactly once across a failure and that the resumed run lines up.
"""

from __future__ import annotations

import os
from typing import Callable

from trainmesh.trainer.callbacks import Callback


def append_durably(path: str, line: str) -> None:
    """Append ``line`` to ``path`` and wait until it is on disk."""
    with open(path, "a") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


class SampleLog(Callback):
    """Log ``RESUME`` and ``STEP`` lines to ``path`` under the attempt's name ``attempt``.

    ``resume_extra`` is appended to the ``RESUME`` line; ``before_step`` runs at every step's
    start and ``after_step(global_step)`` after its line is written (where a job kills or
    stalls itself)."""

    def __init__(
        self,
        path: str,
        attempt: str,
        *,
        resume_extra: str = "",
        before_step: Callable[[], None] | None = None,
        after_step: Callable[[int], None] | None = None,
    ):
        super().__init__()
        self.path, self.attempt, self.resume_extra = path, attempt, resume_extra
        self.before_step, self.after_step = before_step, after_step
        self.started = False

    def on_train_batch_begin(self, step, logs=None):
        if not self.started:  # after the auto-resume: where this attempt starts
            line = f"RESUME {self.attempt} {self.trainer.global_step}"
            append_durably(self.path, f"{line} {self.resume_extra}" if self.resume_extra else line)
            self.started = True
        if self.before_step is not None:
            self.before_step()

    def on_train_batch_end(self, step, logs=None):
        indices = " ".join(map(str, self.trainer._steps.last_indices))
        append_durably(self.path, f"STEP {self.attempt} {self.trainer.epoch} {self.trainer.global_step} {indices}")
        if self.after_step is not None:
            self.after_step(self.trainer.global_step)
