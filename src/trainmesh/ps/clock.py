"""Worker clocks, liveness and the SSP gate of one parameter server.

A worker's clock is the number of iterations it has finished (``client.clock()`` announces
the new count). A pull made at clock ``c`` with staleness ``s`` may be answered once every
live worker has clock ``>= c - s``. Workers expected but not yet heard from count as clock 0
and as last seen when the first worker made contact (workers start together; the servers may
have started long before), so a worker that never starts becomes dead too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class WorkerState:
    clock: int = 0
    last_seen: float = 0.0


@dataclass(frozen=True)
class GateDecision:
    """``ready``: answer now; ``error``: answer with an error naming a dead worker; else wait."""

    ready: bool
    error: str | None = None
    dead_worker: str | None = None


class ClockTable:
    """Clocks and heartbeats of the workers of one server."""

    def __init__(self, num_workers: int = 0, dead_after_s: float = 10.0, time_fn: Callable[[], float] = time.monotonic):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if not dead_after_s > 0:
            raise ValueError(f"dead_after_s must be > 0, got {dead_after_s!r}")
        self.dead_after_s = float(dead_after_s)
        self._now = time_fn
        self._first_contact: float | None = None
        self.workers: dict[str, WorkerState] = {str(w): WorkerState(0, time_fn()) for w in range(num_workers)}
        self.expected = num_workers  # the job's worker count, once known (0: not known)
        self.max_lead = 0  # max of (c - min live clock) over answered gated pulls: the SSP bound

    def expect(self, num_workers: int) -> None:
        """Expect workers ``0 .. num_workers - 1`` (told by a registering client when the server was
        started without a count): each counts at clock 0 until heard from, so no sync round closes
        before a worker that has not registered yet finished it."""
        start = self._first_contact if self._first_contact is not None else self._now()
        for w in range(num_workers):
            self.workers.setdefault(str(w), WorkerState(0, start))
        self.expected = max(self.expected, num_workers)

    def seen(self, worker: str, clock: int | None = None) -> None:
        """Any message from ``worker`` proves it alive; a carried clock can only move forward."""
        if self._first_contact is None:
            self._first_contact = self._now()
            for state in self.workers.values():  # the not-yet-started count from now
                state.last_seen = self._first_contact
        now = self._now()
        state = self.workers.get(worker)
        if state is None:
            state = self.workers.setdefault(str(worker), WorkerState(0, now))
        state.last_seen = now
        if clock is not None and clock > state.clock:
            state.clock = int(clock)

    def is_live(self, worker: str) -> bool:
        state = self.workers.get(str(worker))
        return state is not None and self._now() - state.last_seen <= self.dead_after_s

    def silent_for(self, worker: str) -> float:
        return self._now() - self.workers[str(worker)].last_seen

    def min_live_clock(self) -> float:
        """Smallest clock among live workers; infinity when none is live."""
        now = self._now()
        clocks = [s.clock for s in self.workers.values() if now - s.last_seen <= self.dead_after_s]
        return min(clocks) if clocks else math.inf

    def gate(self, clock: int, staleness: float, sync: bool, drop_dead_workers: bool) -> GateDecision:
        """May a pull at ``clock`` under ``staleness`` be answered now?

        Dead workers leave the min-clock, except that a sync pull (``sync``) held back by a dead
        worker is answered with an error naming it, unless dead workers are dropped.
        """
        if math.isinf(staleness):
            return GateDecision(ready=True)
        needed = clock - staleness
        if sync and not drop_dead_workers:
            for worker, state in sorted(self.workers.items()):
                if state.clock < needed and not self.is_live(worker):
                    silent = self.silent_for(worker)
                    return GateDecision(
                        False,
                        f"sync: worker {worker} sent no heartbeat for {silent:.1f}s "
                        f"(it is at clock {state.clock}, this pull needs {needed})",
                        worker,
                    )
        if self.min_live_clock() >= needed:
            return GateDecision(ready=True)
        return GateDecision(ready=False)

    def record_answered(self, clock: int) -> None:
        """Note the lead of an answered gated pull over the slowest live worker."""
        slowest = self.min_live_clock()
        if not math.isinf(slowest):
            self.max_lead = max(self.max_lead, int(clock - slowest))

    def snapshot(self) -> dict:
        now = self._now()
        return {
            w: {"clock": s.clock, "live": now - s.last_seen <= self.dead_after_s}
            for w, s in sorted(self.workers.items())
        }
