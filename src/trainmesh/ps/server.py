"""``ParameterServer``: one server's request loop.

One thread owns the transport and all state, so no locks. Each request is decoded, checked and
dispatched; a malformed or forged frame is counted and dropped (a request that decodes but
makes no sense gets an ``error`` reply), never crashing the loop. Pushes are applied exactly
once per ``(worker, seq)`` and, with ``durability="wal"``, fsynced to the log before they are
applied and acknowledged. Pulls wait in a queue until the SSP gate lets them through, while
the loop keeps serving everyone else. See docs/parameter_server.md. The request checks
(server_checks.py) and the requests that wait (server_pending.py) are mixins in modules of their own.

Message layout (both ends are this module and ``client.py``):
  pull  meta {"clock", "shards": [dense ids], "rows": {table: ids tensor name}, "floor"}
        -> pull_reply tensors {shard id: flat part, table: (n, dim) rows}, meta {"versions", "min_clock"}
  push  meta {"shards": [dense ids], "rows": {table: [ids name, grads name]},
              "compression": {shard id: {"spec", "meta", "keys"}}, "lr"?, "floor"}
``session`` (every request): the client instance; seqs are per (worker, session).
``floor``: every seq below it has been answered to that session, so it is never resent and the
dedup table may forget it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .ack_codec import AckWriter
from .auth import MALFORMED, SECRET_ENV, UNAUTHENTICATED, RejectGuard, rejection_frame, resolve_secret
from .clock import ClockTable
from .dedup import _session
from .durability import DURABILITY
from .protocol import DEFAULT_MAX_BYTES, AuthenticationError, Message, MessageType, ProtocolError, encode
from .frame_decode import decode
from .server_checks import BadRequest, RequestChecks
from .server_pending import PendingRequests, _clock_of, _enqueue_once
from .server_state import ServerState
from .session import ServerSessions
from .sync_rounds import RoundClosed
from .transport import frame_nbytes

log = logging.getLogger(__name__)


class ParameterServer(RequestChecks, PendingRequests):
    """Serve one transport until ``shutdown`` (a message) or ``stop()``.

    ``directory`` holds the snapshot and write-ahead log (required unless durability is
    ``"none"``); a server started on a directory that has them recovers from them first.
    ``secret`` (else ``TRAINMESH_PS_SECRET`` / ``TRAINMESH_PS_SECRET_FILE``) authenticates every
    frame; only an in-process transport may go without (see auth.py).
    """

    def __init__(
        self,
        transport,
        *,
        server_id: str = "ps",
        num_workers: int = 0,
        durability: str = "none",
        directory: str | os.PathLike | None = None,
        secret: bytes | str | None = None,
        dead_after_s: float = 10.0,
        drop_dead_workers: bool = False,
        snapshot_every: int = 1000,
        snapshot_every_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_BYTES,
        poll_s: float = 0.05,
    ):
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        if durability != "none" and directory is None:
            raise ValueError(f"durability={durability!r} needs a directory, got directory=None")
        if not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise ValueError(f"snapshot_every must be an int >= 1, got {snapshot_every!r}")
        secret = resolve_secret(secret)
        if secret is None and not getattr(transport, "in_process", False):
            raise ValueError(
                f"a parameter server on {getattr(transport, 'address', transport)!r} needs a secret: "
                f"every peer must authenticate, on loopback too. Pass secret= or set {SECRET_ENV} "
                f"(trainmesh.ps.auth.new_secret() makes one). Received: secret=None"
            )
        self.transport = transport
        self.server_id = server_id
        self.num_workers = num_workers
        self.secret = secret
        self.max_message_bytes = max_message_bytes
        self.drop_dead_workers = drop_dead_workers
        self.poll_s = poll_s
        self.clocks = ClockTable(num_workers, dead_after_s)
        self.state = ServerState(durability, directory, secret, snapshot_every, snapshot_every_s)
        self._acks = AckWriter(server_id, secret)
        self.pending_pulls: list[tuple[Any, Message]] = []
        self.pending_clocks: list[tuple[Any, Message]] = []  # clocks waiting for their after_pushes
        self.failed_pushes: set[tuple[str, int]] = set()  # refused pushes: answered, never applied
        # Only what was served counts in bytes_in, requests, pulls and applied_pushes; "rejected"
        # counts refusals, "unauthenticated" the part of them that never authenticated.
        self.counters = {
            "bytes_in": 0,
            "bytes_out": 0,
            "requests": 0,
            "applied_pushes": 0,
            "duplicates": 0,
            "rejected": 0,
            "unauthenticated": 0,
            "pulls": 0,
            "errors_sent": 0,
            "replayed": 0,
            "rounds_applied": 0,
        }
        self.strangers = RejectGuard(server_id, log)
        # Who authenticated on which connection (the handshake, session.py); None: no secret.
        self.sessions = ServerSessions(secret, server_id) if secret is not None else None
        self._running = False
        self._stop_requested = False
        self.counters["replayed"] = self.state.recover(self._mutate)

    # -- the loop ---------------------------------------------------------------------------

    def serve_forever(self) -> None:
        # A stop asked for before the loop started (a launcher that died while this server was
        # still starting: its parent watchdog fires once) must still stop it, not be overwritten.
        self._running = not self._stop_requested
        try:
            while self._running:
                received = self.transport.recv(self.poll_s)
                if received is not None:
                    self.handle(*received)
                self._answer_pending()
                self.state.maybe_snapshot()
        finally:
            self.strangers.flush()
            self.state.close()

    def stop(self) -> None:
        self._stop_requested = True
        self._running = False

    def handle(self, peer, frame) -> None:
        """Serve one received frame (or a message's list of parts) from ``peer`` (whatever it contains)."""
        try:
            # No copy: push gradients and pull ids are only read, while this frame is alive.
            if self.sessions is None:
                msg = decode(frame, None, self.max_message_bytes, copy=False)
            else:
                msg, answer = self.sessions.open(peer, frame, self.max_message_bytes)
                if msg is None:  # a handshake frame: answered (a HELLO) or silently accepted (an AUTH)
                    if answer is not None:
                        self.transport.send(peer, bytes(encode(answer)))
                    return
        except ProtocolError as error:
            self._refuse(peer, error)
            return
        self.counters["bytes_in"] += frame_nbytes(frame)
        if msg.type not in (MessageType.PUSH, MessageType.PULL):
            # init/import values become shard state, updated in place: give them their own memory.
            msg.tensors = {name: tensor.clone() for name, tensor in msg.tensors.items()}
        try:
            self._dispatch(peer, msg, frame)
            self.counters["requests"] += 1
        except Exception as error:  # noqa: BLE001 - no request may take the server down
            self.counters["rejected"] += 1
            if msg.type is MessageType.PUSH:
                self.failed_pushes.add((_session(msg), msg.seq))  # ordered requests stop waiting for it
            code = error.code if isinstance(error, (BadRequest, RoundClosed)) else "bad_request"
            log.warning("ps %s: rejected %s from %s: %s", self.server_id, msg.type.value, msg.sender, error)
            self._error(peer, msg, f"{type(error).__name__}: {error}", code)

    def _refuse(self, peer, error: ProtocolError) -> None:
        """A frame that did not authenticate: counted, logged sparingly, answered with a bare
        rejection at most a few times a second per peer; nothing in it is read or applied."""
        self.counters["rejected"] += 1
        self.counters["unauthenticated"] += 1
        if self.strangers.reject(peer, error):
            code = UNAUTHENTICATED if isinstance(error, AuthenticationError) else MALFORMED
            self.transport.send(peer, rejection_frame(self.server_id, code))

    def _dispatch(self, peer, msg: Message, frame: bytes) -> None:
        kind = msg.type
        if kind in (MessageType.REGISTER, MessageType.PULL, MessageType.CLOCK, MessageType.HEARTBEAT, MessageType.PUSH):
            # A clock carried by a request ordered after pushes not yet applied counts only then.
            self.clocks.seen(msg.sender, _clock_of(msg) if self._ordered(msg) else None)
        session = _session(msg)
        self.state.dedup.advance_floor(session, msg.meta.get("floor"))
        if self.failed_pushes:  # below the floor the client waits on nothing: forget those refusals
            floor = self.state.dedup.floor.get(session, 0)
            self.failed_pushes = {(s, q) for s, q in self.failed_pushes if s != session or q >= floor}
        if kind is MessageType.PUSH:
            if self.state.dedup.is_done(session, msg.seq):
                self.counters["duplicates"] += 1
            else:
                self.state.log_then(frame, self._prepare(msg))  # a bad push fails before the log
                self.counters["applied_pushes"] += 1
            self._send(
                peer, self._acks.encode(msg.seq, self._token(peer))
            )  # (what _reply(ACK, meta {"seq"}) would send)
        elif kind in (MessageType.INIT, MessageType.IMPORT):
            if kind is MessageType.INIT:
                self._check_sync_has_workers(msg)
            self.state.log_then(frame, self._prepare(msg))
            if self.state.durability == "snapshot":
                self.state.maybe_snapshot(force=True)  # no log: new keys must not wait for the timer
            self._reply(peer, msg, MessageType.OK)
        elif kind is MessageType.PULL:
            self._check_pull(msg)
            self.counters["pulls"] += 1
            _enqueue_once(self.pending_pulls, peer, msg)  # a resent pull waits once
            self._answer_pending()
        elif kind is MessageType.CLOCK:
            _enqueue_once(self.pending_clocks, peer, msg)
            self._answer_pending()
        elif kind in (MessageType.REGISTER, MessageType.HEARTBEAT):
            if kind is MessageType.REGISTER:
                self._expect_workers(msg)
            self._reply(peer, msg, MessageType.OK, meta={"num_workers": self.num_workers, "server_id": self.server_id})
            self._answer_pending()
        elif kind is MessageType.EXPORT:
            tensors, meta = self.state.export(msg.meta)
            if msg.meta.get("remove"):
                self.state.maybe_snapshot(force=True)  # dropped shards must not come back on replay
            self._reply(peer, msg, MessageType.OK, tensors, meta)
        elif kind is MessageType.STATS:
            self._reply(peer, msg, MessageType.OK, meta=self.stats())
        elif kind is MessageType.SHUTDOWN:
            self._reply(peer, msg, MessageType.OK)
            self.stop()
        else:
            raise BadRequest(f"a server does not accept {kind.value!r} messages")

    def _prepare(self, msg: Message):
        """Check a mutation completely (raising for a bad one) and return the call applying it.
        The one apply path, shared by live requests (after the WAL append) and WAL replay."""
        if msg.type is MessageType.INIT:
            return self.state.prepare_init(msg)
        if msg.type is MessageType.IMPORT:
            return self.state.prepare_import(msg)
        updates = self.state.prepare_push(msg)

        def apply_push() -> None:
            for update in updates:
                update()
            self.state.dedup.mark(_session(msg), msg.seq)

        return apply_push

    def _mutate(self, msg: Message) -> None:
        """Replay one logged frame (dedup skips pushes the snapshot already holds)."""
        if msg.type is MessageType.CLOCK:  # sync rounds closed and applied (see _apply_due_rounds)
            applied = msg.meta.get("apply_rounds")
            if applied is None:  # a log written before markers carried several rounds
                applied = [msg.meta["apply_round"]]
            for round_ in applied:
                self.state.apply_round(round_)
            closed = msg.meta.get("closed_below")
            if isinstance(closed, int):
                self.state.rounds.closed_below = max(self.state.rounds.closed_below, closed)
            return
        if msg.type is MessageType.PUSH and self.state.dedup.is_done(_session(msg), msg.seq):
            return
        self._prepare(msg)()

    # -- replies ----------------------------------------------------------------------------

    def _reply(
        self, peer, request: Message, kind: MessageType, tensors: dict | None = None, meta: dict | None = None
    ) -> None:
        reply = Message(kind, self.server_id, request.seq, tensors=tensors or {}, meta=meta or {})
        token = self._token(peer)  # a reply is sealed as the peer's connection is: token, else HMAC
        self._send(peer, encode(reply, None if token else self.secret, self.max_message_bytes, token=token))

    def _token(self, peer) -> bytes | None:
        return None if self.sessions is None else self.sessions.token(peer)

    def _send(self, peer, frame: bytes) -> None:
        self.counters["bytes_out"] += len(frame)
        self.transport.send(peer, frame)

    def _error(self, peer, request: Message, text: str, code: str, **extra) -> None:
        self.counters["errors_sent"] += 1
        self._reply(peer, request, MessageType.ERROR, meta={"error": text, "code": code, **extra})

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "server_id": self.server_id,
            "max_staleness_observed": self.clocks.max_lead,
            "clocks": self.clocks.snapshot(),
            "waiting_pulls": len(self.pending_pulls),
            "waiting_clocks": len(self.pending_clocks),
            "open_round_pushes": self.state.rounds.pending_pushes,
            "shards": len(self.state.shards),
            "params": sorted(self.state.params),
            "durability": self.state.durability,
            "time": time.time(),
        }
