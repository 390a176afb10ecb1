"""Turn "a collective timed out" into "rank 1 never reached step 7's all-reduce".

Every process notes where it is (step, phase, time) in the job's own c10d store (the one
torch.distributed rendezvoused with; nothing of ours on the network). When a collective fails
(timeout, or a peer's connection closed), the surviving processes read every rank's last note
and raise :class:`CollectiveTimeoutError` naming the ranks that are behind or silent, the step
and the operation, instead of gloo's bare "timed out" or a silent hang.
"""

from __future__ import annotations

import time

import torch.distributed as dist

_KEY = "trainmesh/progress/{}"


class CollectiveTimeoutError(RuntimeError):
    """A collective failed; ``missing_ranks`` are the processes that did not get there."""

    def __init__(self, message: str, missing_ranks: list[int], step: int, phase: str):
        super().__init__(message)
        self.missing_ranks, self.step, self.phase = missing_ranks, step, phase


def _default_store():
    try:  # the default group's store: private in torch, so degrade to no diagnosis if it moves
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None


class ProgressBeacon:
    """``mark(step)`` once per step (one store write), ``phase = ...`` as the step goes on (local
    only), ``diagnose(error)`` after a collective failed."""

    def __init__(self) -> None:
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.store = _default_store() if self.enabled else None
        self.rank = dist.get_rank() if self.enabled else 0
        self.world_size = dist.get_world_size() if self.enabled else 1
        self.step, self.phase, self.since = -1, "start", time.time()

    def mark(self, step: int, phase: str = "step") -> None:
        self.step, self.phase, self.since = step, phase, time.time()
        if self.store is not None:
            try:
                self.store.set(_KEY.format(self.rank), f"{step}|{phase}|{self.since:.3f}")
            except Exception:  # noqa: BLE001 - a beacon must never break training
                self.store = None

    def _read(self) -> dict[int, tuple[int, str, float] | None]:
        seen: dict[int, tuple[int, str, float] | None] = {}
        for rank in range(self.world_size):
            key = _KEY.format(rank)
            try:
                if not self.store.check([key]):
                    seen[rank] = None
                    continue
                step, phase, at = self.store.get(key).decode().split("|", 2)
                seen[rank] = (int(step), phase, float(at))
            except Exception:  # noqa: BLE001
                seen[rank] = None
        return seen

    def diagnose(self, error: BaseException) -> CollectiveTimeoutError | None:
        """The error to raise instead of ``error``, or None when nothing more can be said."""
        if not self.enabled or self.store is None:
            return None
        seen = self._read()
        now = time.time()
        # Behind: never reported, or still at an earlier step than this process.
        missing = [r for r, note in seen.items() if r != self.rank and (note is None or note[0] < self.step)]
        if not missing:
            return None
        details = ", ".join(
            f"rank {r}: " + ("never reported" if seen[r] is None else
                             f"last started step {seen[r][0]} {now - seen[r][2]:.0f}s ago")
            for r in missing)
        message = (f"rank {self.rank}: '{self.phase}' at step {self.step} failed after {now - self.since:.0f}s "
                   f"waiting for rank(s) {missing} ({details}). Underlying error: {str(error).splitlines()[0][:300]}")
        return CollectiveTimeoutError(message, missing, self.step, self.phase)
