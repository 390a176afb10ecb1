"""A worker's bounded-staleness copy of its dense parameters (SSP / async), as in SSPTable
(Ho et al., NIPS 2013), on the client side.

Sync pulls every step and waits. Under ``ssp:s`` a worker keeps the values of its last pull
and reuses them for as long as the SSP bound allows, so communication overlaps compute:

* A pull answer carries ``fresh_clock`` m, the smallest live clock of the answering servers when
  they answered. A worker's clock counts on a server only after the pushes sent before it were
  applied, so the values include every update made at clocks < m, from every live worker.
* The worker, having finished c iterations (``client.clock_value``), may compute iteration c
  on those values while ``c - s <= m``. That is the servers' own gate (``ClockTable.gate``
  answers a pull at clock c once the min live clock is ``>= c - s``), so a cached read is never
  staler than a pull the servers would have answered; ``max_lead`` (max of c - m over the
  steps) records it, and stays ``<= s``.
* While the copy is fresh enough, ``refresh`` adopts a finished prefetch (if any) and sends the
  next one: a pull at the current clock, which the gate answers at once (the servers' min clock
  is at least the copy's m). Only when the copy is too old does it block: on the prefetch in
  flight if that one suffices, else on a gated pull at the current clock.

The worker's own pushes since the copy's pull are not in it (no read-my-writes): its
gradient is divided by the number of workers, and the bound above is what SSP promises.
Async (s infinite) never blocks after the first pull.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Any, Mapping

import torch


class DenseCache:
    """Values of ``names`` on the servers, written into ``params`` (the model's tensors)."""

    def __init__(self, client: Any, names: list[str], params: Mapping[str, torch.Tensor], staleness: float):
        if not staleness >= 0:
            raise ValueError(f"staleness must be >= 0 (math.inf for async). Received: staleness={staleness!r}")
        self.client, self.names, self.params, self.staleness = client, list(names), params, float(staleness)
        self.fresh_clock: float = -math.inf  # nothing pulled yet: never fresh
        self._prefetch: Future | None = None
        # What the worker did, to check the bound and the saving from outside:
        self.steps = 0  # refresh() calls
        self.blocking_pulls = 0  # of which waited for a pull
        self.max_lead = 0  # max over steps of clock - fresh_clock

    def fresh_enough(self, clock: int) -> bool:
        return clock - self.staleness <= self.fresh_clock

    def load(self) -> None:
        """Pull and wait (a gated pull at the current clock): the copy is then fresh enough."""
        self._adopt(self.client.pull(self.names, with_clock=True).result())

    def refresh(self) -> None:
        """Make the parameters usable at the client's current clock, blocking only if the bound
        requires it (see the module docstring)."""
        clock = self.client.clock_value
        self.steps += 1
        if self._prefetch is not None and self._prefetch.done():
            self._adopt_prefetch()
        if not self.fresh_enough(clock):
            self.blocking_pulls += 1
            if self._prefetch is not None:
                self._adopt_prefetch()  # waits: it left earlier, and may be fresh enough
            if not self.fresh_enough(clock):
                self.load()
            # Its answer is what the servers hold now; a prefetch now would fetch the same.
        elif self._prefetch is None:
            self._prefetch = self.client.pull(self.names, with_clock=True)
        assert self.fresh_enough(clock), (clock, self.fresh_clock, self.staleness)
        if not math.isinf(self.staleness) and not math.isinf(self.fresh_clock):
            self.max_lead = max(self.max_lead, int(clock - self.fresh_clock))

    def drain(self) -> None:
        """Wait for a prefetch in flight (its error, if any, is raised)."""
        if self._prefetch is not None:
            self._adopt_prefetch()

    def _adopt_prefetch(self) -> None:
        future, self._prefetch = self._prefetch, None
        self._adopt(future.result())

    def _adopt(self, answer: tuple[dict[str, torch.Tensor], float]) -> None:
        # The newest copy wins even if its fresh clock is lower (a worker counted dead came back):
        # the bound is checked against the copy in use, and a too-old one is replaced by a gated pull.
        values, fresh_clock = answer
        with torch.no_grad():
            for name in self.names:
                param = self.params[name]
                param.copy_(values[name].reshape(param.shape).to(param.dtype))
        self.fresh_clock = fresh_clock
