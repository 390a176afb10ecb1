"""The PS client's requests and replies, for whoever holds the sockets (see client_io.py).

Seqs start at 1 per server (0 marks untracked heartbeats) and per client ``session``; each request
carries ``floor``, the lowest seq still unanswered, so the server can forget older ones. An
unanswered request is resent unchanged (same seq) after ``retry_after_s``, doubling up to 4x;
after ``request_timeout_s`` it fails. A connection authenticates once (session.py); requests made
before that wait and are sealed with the session token when it is ready.
"""

from __future__ import annotations

import logging
import time

from .ack_codec import read_ack
from .auth import UNAUTHENTICATED, refusal_text, rejection_code, rejection_in
from .client_gather import Gather, Pending, ServerLink
from .errors import PSAuthError, PSError, PSTimeoutError
from .protocol import Message, MessageType, ProtocolError, decode, encode, encode_parts, frame_flags
from .session import HANDSHAKE_MAX_BYTES

# Handshakes in a row that end refused, with no request served between them: then the refusal
# is the server's word, not a lost session (a restarted server), and requests fail.
_MAX_HANDSHAKES = 3

log = logging.getLogger(__name__)
STOP = object()  # queued by ClientIO.close: the I/O thread ends


class RequestBook:
    """Request numbering, sealing, matching, resends and refusals. Every method runs with the
    sockets held (``ClientIO._lock``): ZeroMQ sockets are not thread-safe."""

    sender: str
    session: str
    retry_after_s: float
    request_timeout_s: float
    _servers: list[ServerLink]
    _stats: dict[str, int]

    # -- the handshake (session.py): once per connection, then frames carry the session token --

    def _hello(self, server: ServerLink, now: float) -> None:
        server.transport.send(bytes(encode(server.session.hello(now))))

    def _seal(self, server: ServerLink, msg: Message) -> list | None:
        """``msg``'s parts sealed for ``server``'s connection; None while it is not authenticated."""
        if server.session is None:
            return encode_parts(msg)
        if server.session.state != "ready":
            return None
        return encode_parts(msg, token=server.session.token)

    def _on_unsealed(self, server: ServerLink, frame) -> None:
        """A frame without a seal: the server's challenge, or a rejection (see auth.py)."""
        try:
            msg = decode(frame, None, HANDSHAKE_MAX_BYTES)
        except ProtocolError as error:
            self._stats["rejected_replies"] += 1
            log.warning("PS client %s: dropped a malformed reply from %s: %s", self.sender, server.name, error)
            return
        session = server.session
        if msg.type is MessageType.CHALLENGE:
            auth, genuine = session.answer(msg)
            if auth is None:
                return  # the answer to an earlier HELLO of ours
            server.transport.send(bytes(encode(auth)))  # a stranger's server still sees our AUTH fail: it logs it
            if not genuine:
                return self._refused(server, UNAUTHENTICATED)
            for pending in server.pending.values():  # what waited for the handshake, sealed now
                pending.frame = encode_parts(pending.msg, token=session.token)
                pending.sent = time.monotonic()
                server.transport.send(pending.frame)
            return
        code = rejection_in(msg)
        if code is None:
            self._stats["rejected_replies"] += 1
            return
        if code == UNAUTHENTICATED and session.state == "hello":
            return  # refused frames sent before this handshake started
        if code == UNAUTHENTICATED and session.attempts < _MAX_HANDSHAKES:
            # The server does not know this connection's session: a restarted server, a forgotten
            # session, or a challenge it no longer holds. Authenticate again; requests wait.
            self._hello(server, time.monotonic())
            return
        session.state, session.token, session.attempts = "none", None, 0
        self._refused(server, code)

    def _send_new(self, gather: Gather, messages: list[tuple[int, Message]]) -> None:
        now = time.monotonic()
        for slot, (index, msg) in enumerate(messages):
            server = self._servers[index]
            msg.seq = server.next_seq
            server.next_seq += 1
            msg.meta["floor"] = min(server.pending, default=msg.seq)
            msg.meta["session"] = self.session
            if msg.type in (MessageType.PULL, MessageType.CLOCK):
                # Order after this session's unacknowledged pushes, even if one of them is
                # dropped and resent later (see ParameterServer: ordered requests).
                after = [seq for seq, p in server.pending.items() if p.kind == MessageType.PUSH.value]
                if after:
                    msg.meta["after_pushes"] = after
            try:
                # Large tensors are not copied: ZeroMQ sends them from the caller's memory (a
                # multipart message; see protocol.encode_parts and PSClient.push).
                frame = self._seal(server, msg)
                if frame is None:
                    encode_parts(msg)  # (a message that cannot be encoded fails now, not after the handshake)
            except (TypeError, ValueError) as error:
                gather.fail(error)
                return
            server.pending[msg.seq] = Pending(gather, slot, msg.type.value, msg, frame, now, now, self.retry_after_s)
            self._stats["requests"] += 1
            if frame is not None:
                server.transport.send(frame)
            elif server.session.state == "none":  # refused before: try again for this request
                self._hello(server, now)

    def _on_frame(self, index: int, frame: bytes) -> None:
        server = self._servers[index]
        if server.session is not None and frame_flags(frame) == 0:
            return self._on_unsealed(server, frame)
        token = None if server.session is None else server.session.token
        try:
            # A push's ack is read by its own short path; any other frame by the general decoder.
            reply = read_ack(frame, None, token) or decode(frame, None, token=token)
        except ProtocolError as error:
            code = rejection_code(frame)  # unsigned: a server that does not share our secret says no
            if code is not None:
                return self._refused(server, code)
            self._stats["rejected_replies"] += 1
            log.warning("PS client %s: dropped a malformed reply from %s: %s", self.sender, server.name, error)
            return
        if not reply.seq and (code := rejection_in(reply)) is not None:  # (read so when we have no secret)
            return self._refused(server, code)
        if server.session is not None:
            server.session.attempts = 0  # served: a later refusal means a lost session again
        pending = server.pending.pop(reply.seq, None) if reply.seq else None
        if pending is None:
            return  # a heartbeat's reply, or a second answer to a resent request
        if reply.type is MessageType.ERROR:
            text = str(reply.meta.get("error", "unknown error"))
            code = str(reply.meta.get("code", "error"))
            if code == "dead_worker":
                error = PSTimeoutError(
                    f"{pending.kind} to server {server.name}: {text}", code, worker=reply.meta.get("worker")
                )
            else:
                error = PSError(f"{pending.kind} to server {server.name} failed: {text}", code)
            pending.gather.fail(error)
            return
        pending.gather.deliver(pending.slot, reply)

    def _refused(self, server: ServerLink, code: str) -> None:
        """The server rejected our frames (see auth.py): fail what waits on it, naming authentication,
        instead of resending until the timeout. The words are ours, not the (unsigned) reply's."""
        self._stats["refusals"] += 1
        for seq, pending in list(server.pending.items()):
            del server.pending[seq]
            pending.gather.fail(
                PSAuthError(
                    f"{pending.kind} (seq {seq}) to server {server.name}: {refusal_text(code, server.name)}", code
                )
            )

    def _resend_due(self, now: float) -> None:
        for server in self._servers:
            session = server.session
            if session is not None and session.state == "hello" and now - session.hello_sent >= self.retry_after_s:
                server.transport.send(bytes(encode(session.resend_hello(now))))  # lost (a server not up yet)
            for seq, pending in list(server.pending.items()):
                if pending.gather.future.done():  # failed elsewhere: stop trying
                    del server.pending[seq]
                elif now - pending.first_sent > self.request_timeout_s:
                    del server.pending[seq]
                    pending.gather.fail(
                        PSTimeoutError(
                            f"{pending.kind} (seq {seq}) to server {server.name}: no reply for "
                            f"{now - pending.first_sent:.1f}s (request_timeout_s={self.request_timeout_s})"
                        )
                    )
                elif pending.frame is not None and now - pending.sent >= pending.interval:
                    pending.sent = now
                    pending.interval = min(pending.interval * 2, 4 * self.retry_after_s)
                    self._stats["resends"] += 1
                    server.transport.send(pending.frame)

    def _heartbeat(self) -> None:
        msg = Message(MessageType.HEARTBEAT, self.sender, 0, meta={"clock": self._clock()})
        for server in self._servers:
            frame = self._seal(server, msg)
            if frame is not None:  # (none while the connection authenticates)
                server.transport.send(frame)

    def _fail_all(self, error: BaseException) -> None:
        for server in self._servers:
            for pending in server.pending.values():
                pending.gather.fail(error)
            server.pending.clear()
        while (command := self._next_command()) is not None:
            if command is not STOP:
                command[0].fail(error)
