"""Exactly-once pushes: which push seqs a server has applied, per client session.

A client resends an unanswered push with the same seq, so a server must recognise a push it
already applied (its ack was lost) and acknowledge it again without applying it twice.
``DedupTable`` is that record, keyed by ``_session(msg)``; it is part of the server's snapshots
(``to_json`` / ``load_json``), so a restarted server still recognises what it applied before. It
is apart from ``ServerState`` (server_state.py), which holds one, because the request loop asks
it as well: a pipelined clock or pull waits until the pushes it lists are applied or refused
(server_pending.py).
"""

from __future__ import annotations

from typing import Any

from .protocol import Message


class DedupTable:
    """Per worker: ``floor`` (every seq below it is finished) and the applied push seqs above it."""

    def __init__(self) -> None:
        self.floor: dict[str, int] = {}
        self.applied: dict[str, set[int]] = {}

    def advance_floor(self, worker: str, floor: Any) -> None:
        if not isinstance(floor, int) or isinstance(floor, bool) or floor <= self.floor.get(worker, 0):
            return
        self.floor[worker] = floor
        self.applied[worker] = {s for s in self.applied.get(worker, ()) if s >= floor}

    def is_done(self, worker: str, seq: int) -> bool:
        return seq < self.floor.get(worker, 0) or seq in self.applied.get(worker, ())

    def mark(self, worker: str, seq: int) -> None:
        self.applied.setdefault(worker, set()).add(seq)

    def to_json(self) -> dict:
        return {
            w: {"floor": self.floor.get(w, 0), "applied": sorted(self.applied.get(w, ()))}
            for w in sorted(set(self.floor) | set(self.applied))
        }

    def load_json(self, data: dict) -> None:
        self.floor = {w: int(v["floor"]) for w, v in data.items()}
        self.applied = {w: set(v["applied"]) for w, v in data.items()}


def _session(msg: Message) -> str:
    """The dedup key: seqs count per client instance (a restarted worker starts again at 1)."""
    return f"{msg.sender}@{msg.meta.get('session', '')}"
