"""Requests that wait: clocks and pulls behind the pushes sent before them, pulls behind the SSP gate.

A client pipelines push, clock and pull without waiting for acks, so a clock or a pull may arrive
before a push it follows (that push lost and resent). ``ParameterServer`` queues such requests
(``pending_clocks``, ``pending_pulls``) and ``_answer_pending``, run after every poll of the
transport and every request that may unblock one, answers those now in order: their clocks count,
the sync rounds every live worker clocked past are applied, and only then are the pulls the SSP
gate lets through answered. A mixin of ``ParameterServer`` (server.py), apart from the dispatch
of single requests because this bookkeeping spans many of them. It uses the server's
``pending_clocks``, ``pending_pulls``, ``failed_pushes``, ``clocks``, ``state``, ``counters``,
``num_workers``, ``server_id``, ``secret``, ``drop_dead_workers``, ``_reply`` and ``_error``, all
set up by ``ParameterServer``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from .dedup import _session
from .protocol import Message, MessageType, encode
from .server_checks import BadRequest

# server.py's logger: these warnings keep the name they were logged under before they moved here.
log = logging.getLogger("trainmesh.ps.server")


class PendingRequests:
    """``_answer_pending`` and what it uses: ordering, closing sync rounds, the SSP gate."""

    def _ordered(self, msg: Message) -> bool:
        """Whether every push listed in ``meta["after_pushes"]`` (same session) was applied or
        refused. A client pipelines push, clock and pull without waiting for acks; if the push
        frame is lost and resent, this keeps the clock and the pull from overtaking it."""
        after = msg.meta.get("after_pushes")
        if after is None:
            return True
        if not isinstance(after, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in after):
            raise BadRequest(f"after_pushes must be a list of push seqs, got {after!r:.200}")
        session = _session(msg)
        return all(self.state.dedup.is_done(session, seq) or (session, seq) in self.failed_pushes for seq in after)

    def _answer_pending(self) -> None:
        if self.pending_clocks:
            still_waiting = []
            for peer, msg in self.pending_clocks:
                if self._ordered(msg):
                    self.clocks.seen(msg.sender, _clock_of(msg))
                    self._reply(
                        peer, msg, MessageType.OK, meta={"num_workers": self.num_workers, "server_id": self.server_id}
                    )
                else:
                    still_waiting.append((peer, msg))
            self.pending_clocks = still_waiting
        self._answer_pending_pulls()

    def _apply_due_rounds(self) -> None:
        """Close every sync round all live workers have clocked past and apply the open ones among
        them (before any pull is answered), logged as one marker after the pushes they sum, so a
        replay applies them at the same point and refuses the same late pushes."""
        if not self.clocks.workers:  # no worker known yet: nobody finished anything
            return
        slowest = self.clocks.min_live_clock()
        rounds = self.state.rounds
        if math.isinf(slowest) or slowest <= rounds.closed_below:
            return
        closing = range(rounds.closed_below, int(slowest))
        missing = sorted(w for w, s in self.clocks.workers.items() if s.clock < slowest and not self.clocks.is_live(w))
        if missing and rounds.rounds.keys() & set(closing):
            log.warning(
                "ps %s: sync rounds %d-%d close without worker(s) %s (declared dead); their late pushes "
                "for these rounds will be refused",
                self.server_id,
                closing.start,
                closing.stop - 1,
                missing,
            )
        due = rounds.close_below(slowest)
        if not due:  # nothing to apply: no marker (a clock must not cost a log write, an fsync with
            return  # "wal"); closed_below reaches the log with the next marker or snapshot, and a
            # replay, lower until then, still accepts every push the live server accepted
        marker = encode(
            Message(
                MessageType.CLOCK, self.server_id, 0, meta={"apply_rounds": due, "closed_below": rounds.closed_below}
            ),
            self.secret,
        )
        self.state.log_then(marker, lambda: [self.state.apply_round(r) for r in due])
        self.counters["rounds_applied"] += len(due)

    def _answer_pending_pulls(self) -> None:
        # A waiting pull whose pushes are now in carries a clock that counts from now on. Count
        # every such clock first, then close the rounds they complete, and only then answer: a
        # pull must never be answered at a clock whose rounds are not applied yet (answering
        # before applying let a pull at clock c miss round c - 1; issue 42).
        ordered = [(peer, msg) for peer, msg in self.pending_pulls if self._ordered(msg)]
        for _, msg in ordered:
            self.clocks.seen(msg.sender, _clock_of(msg))
        self._apply_due_rounds()
        ready_to_gate = {id(msg) for _, msg in ordered}
        still_waiting = []
        for peer, msg in self.pending_pulls:
            if id(msg) not in ready_to_gate:
                still_waiting.append((peer, msg))
                continue
            staleness, sync = self.state.pull_consistency(msg)
            clock = msg.meta.get("clock", 0)
            decision = self.clocks.gate(clock, staleness, sync, self.drop_dead_workers)
            if decision.error is not None:
                self._error(peer, msg, decision.error, "dead_worker", worker=decision.dead_worker)
            elif decision.ready:
                if not math.isinf(staleness):
                    self.clocks.record_answered(clock)
                # The values include every update made at clocks < min_clock (a clock counts only
                # after its worker's pushes): a client may reuse them while its clock - s <= it.
                slowest = self.clocks.min_live_clock()
                try:  # reading or encoding (e.g. a reply over max_message_bytes) fails this pull only
                    tensors, versions = self.state.read(msg)
                    self._reply(
                        peer,
                        msg,
                        MessageType.PULL_REPLY,
                        tensors,
                        {"versions": versions, "min_clock": None if math.isinf(slowest) else int(slowest)},
                    )
                except Exception as error:  # noqa: BLE001 - answered, not fatal
                    self.counters["rejected"] += 1
                    self._error(peer, msg, f"{type(error).__name__}: {error}", "bad_request")
            else:
                still_waiting.append((peer, msg))
        self.pending_pulls = still_waiting


def _clock_of(msg: Message) -> int | None:
    clock = msg.meta.get("clock")
    return clock if isinstance(clock, int) and not isinstance(clock, bool) else None


def _enqueue_once(queue: list[tuple[Any, Message]], peer, msg: Message) -> None:
    """Queue ``msg`` unless a resend of it (same peer, sender and seq) is already waiting."""
    if not any(p == peer and m.sender == msg.sender and m.seq == msg.seq for p, m in queue):
        queue.append((peer, msg))
