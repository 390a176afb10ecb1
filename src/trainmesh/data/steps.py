"""Index batches as the loader consumes them: a plan per epoch, and the torch batch sampler that reads it."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np


class PlanBatchSampler:
    """The micro-batches the torch DataLoader must read this pass.

    Torch forbids replacing a DataLoader's ``batch_sampler`` after construction, and persistent
    workers re-iterate the same object every pass, so this object stays and its list changes.
    """

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self.batches))

    def __len__(self) -> int:
        return len(self.batches)


class IndexBatches:
    """Any iterable of index batches (a torch ``BatchSampler``, a list of lists) with the
    ``GlobalBatchSampler`` interface; its state counts the batches consumed this pass."""

    micro_batches = 1

    def __init__(self, batches: Iterable[Iterable[int]]):
        self.batches = batches
        self.epoch = 0
        self.consumed = 0
        self._total = 0

    def __len__(self) -> int:
        return len(self.batches) - self.consumed  # type: ignore[arg-type]

    def plan(self) -> list[tuple[int, list[np.ndarray]]]:
        all_batches = [np.asarray(list(b), dtype=np.int64) for b in self.batches]
        self._total = len(all_batches)
        return [(j + 1, [b]) for j, b in enumerate(all_batches) if j >= self.consumed]

    def advance(self, consumed: int) -> None:
        self.consumed = consumed
        if consumed >= self._total:
            self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed = int(epoch), 0
            inner = getattr(self.batches, "sampler", self.batches)
            if hasattr(inner, "set_epoch"):
                inner.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed_batches": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_epoch(int(state["epoch"]))
        self.consumed = int(state["consumed_batches"])
