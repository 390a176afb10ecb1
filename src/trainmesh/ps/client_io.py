"""The PS client's I/O thread: owns every transport, numbers, resends and matches requests.

Callers hand over ``[(server index, Message)]`` and get one future, done when every server
answered (``assemble(replies)`` builds its result on this thread). Seqs start at 1 per server
(0 marks untracked heartbeats) and per client ``session``; each request carries ``floor``, the lowest seq still unanswered,
so the server can forget older ones. An unanswered request is resent unchanged (same seq)
after ``retry_after_s``, doubling up to 4x; after ``request_timeout_s`` it fails.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from .ack_codec import read_ack
from .auth import UNAUTHENTICATED, refusal_text, rejection_code, rejection_in, resolve_secret
from .errors import PSAuthError, PSError, PSTimeoutError
from .protocol import Message, MessageType, ProtocolError, encode, encode_parts, frame_flags
from .frame_decode import decode
from .session import HANDSHAKE_MAX_BYTES, ClientSession

# Handshakes in a row that end refused, with no request served between them: then the refusal
# is the server's word, not a lost session (a restarted server), and requests fail.
_MAX_HANDSHAKES = 3

log = logging.getLogger(__name__)
_STOP = object()


class Gather:
    """One API call: waits for a reply from each of its messages, then resolves ``future``."""

    def __init__(self, count: int, assemble: Callable[[list[Message]], Any] | None):
        self.future: Future = Future()
        self.replies: list[Message | None] = [None] * count
        self.missing = count
        self.assemble = assemble
        if count == 0:
            self._finish()

    def deliver(self, slot: int, reply: Message) -> None:
        if self.future.done() or self.replies[slot] is not None:
            return
        self.replies[slot] = reply
        self.missing -= 1
        if self.missing == 0:
            self._finish()

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def _finish(self) -> None:
        try:
            result = self.assemble(self.replies) if self.assemble else None
        except BaseException as error:  # noqa: BLE001 - goes to the caller through the future
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


@dataclass
class _Pending:
    gather: Gather
    slot: int
    kind: str
    msg: Message
    frame: list | None  # the encoded request's parts (large tensors are views of the caller's
    # memory); None until the connection has authenticated (it is sealed with the session token)
    first_sent: float
    sent: float
    interval: float


@dataclass
class _Server:
    name: str
    transport: Any = None
    next_seq: int = 1
    pending: dict[int, _Pending] = field(default_factory=dict)
    session: ClientSession | None = None  # None: no secret, frames go unsealed (in-process tests)


class ClientIO:
    """The thread behind ``PSClient``; ``endpoints`` are addresses (created on the thread) or transports."""

    def __init__(
        self,
        endpoints,
        *,
        from_addresses: bool,
        identity: bytes,
        sender: str,
        secret,
        retry_after_s: float,
        heartbeat_s: float,
        request_timeout_s: float,
        server_names: list[str],
        clock: Callable[[], int],
    ):
        # The secret (given, else from the environment; see auth.py) checked and as bytes once,
        # not at every encode and decode.
        self.sender, self.key, self.identity = sender, resolve_secret(secret), identity
        # Seqs restart with every client: the server dedups per (worker, session).
        self.session = identity.decode("ascii", "replace")
        self.retry_after_s, self.heartbeat_s, self.request_timeout_s = retry_after_s, heartbeat_s, request_timeout_s
        self._resend_scan_s = min(0.025, retry_after_s / 4)
        self._clock = clock
        self._endpoints, self._from_addresses = list(endpoints), from_addresses
        self._servers = [_Server(name) for name in server_names]
        # Submitted commands, oldest first. A deque, not a queue.Queue: append and popleft are
        # atomic, so neither side takes a lock per request (the wake pipe does the waking).
        self._commands: collections.deque = collections.deque()
        self._stats = {"resends": 0, "rejected_replies": 0, "requests": 0, "refusals": 0}
        self._closed = False
        self._failure: BaseException | None = None
        # True while the thread is (about to be) blocked in its poll with no command queued: only
        # then does submit() pay a wake-up write (pipelined submits find it awake).
        self._sleeping = False
        # submit() writes a byte here so a thread blocked in the socket poll wakes at once.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._thread = threading.Thread(target=self._run, name=f"ps-client-io-{sender}", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------------------------

    def submit(self, messages: list[tuple[int, Message]], assemble: Callable | None = None) -> Future:
        gather = Gather(len(messages), assemble)
        if self._closed or self._failure is not None:
            gather.fail(
                PSError(
                    f"PS client of worker {self.sender} is closed" + (f": {self._failure}" if self._failure else "")
                )
            )
        elif messages:
            self._commands.append((gather, messages))
            if self._sleeping:  # (read after the append: a thread going to sleep sees the command)
                self._wake()
        return gather.future

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):  # pipe full (a wake is pending anyway) or closed
            pass

    def counters(self) -> dict[str, int]:
        transports = [s.transport for s in self._servers if s.transport is not None]
        return {
            **self._stats,
            "bytes_sent": sum(t.bytes_sent for t in transports),
            "bytes_received": sum(t.bytes_received for t in transports),
        }

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._commands.append(_STOP)
            self._wake()
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                for fd in (self._wake_read, self._wake_write):
                    os.close(fd)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._connect()
            self._loop()
        except BaseException as error:  # noqa: BLE001 - reported to every waiting caller
            log.exception("PS client I/O thread of worker %s failed", self.sender)
            self._failure = error
        finally:
            self._fail_all(self._failure or PSError(f"PS client of worker {self.sender} was closed"))
            for server in self._servers:
                if server.transport is not None:
                    server.transport.close()

    def _connect(self) -> None:
        from .transport import ZmqClientTransport

        for server, endpoint in zip(self._servers, self._endpoints):
            server.transport = ZmqClientTransport(endpoint, self.identity) if self._from_addresses else endpoint
            if self.key is not None:
                server.session = ClientSession(self.key, self.sender)
                self._hello(server, time.monotonic())

    # -- the handshake (session.py): once per connection, then frames carry the session token --

    def _hello(self, server: _Server, now: float) -> None:
        server.transport.send(bytes(encode(server.session.hello(now))))

    def _seal(self, server: _Server, msg: Message) -> list | None:
        """``msg``'s parts sealed for ``server``'s connection; None while it is not authenticated."""
        if server.session is None:
            return encode_parts(msg)
        if server.session.state != "ready":
            return None
        return encode_parts(msg, token=server.session.token)

    def _on_unsealed(self, server: _Server, frame) -> None:
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

    def _socket_poller(self):
        """A ``zmq.Poller`` over every server socket and the wake pipe, so the thread sleeps until a
        reply or a new request arrives; ``None`` when a transport is not ZeroMQ (tests)."""
        if not all(getattr(s.transport, "socket", None) is not None for s in self._servers):
            return None
        import zmq

        poller = zmq.Poller()
        self._socket_index = {}
        for index, server in enumerate(self._servers):
            poller.register(server.transport.socket, zmq.POLLIN)
            self._socket_index[server.transport.socket] = index
        poller.register(self._wake_read, zmq.POLLIN)
        return poller

    def _wait(self, poller, busy: bool):
        """Sleep until something may be ready; return ``(first queued command or None, indices of
        servers that may have replies)``. Without a poller, wait on the wake pipe and poll the
        transports every millisecond while busy."""
        if poller is None:
            self._sleeping = True
            if not self._commands:  # (checked after the flag is set: see submit)
                readable, _, _ = select.select([self._wake_read], [], [], 0.001 if busy else 0.02)
                if readable:
                    self._drain_wake()
            self._sleeping = False
            return self._next_command(), range(len(self._servers))
        self._sleeping = True
        # Wakes at once on a reply or a wake byte; with a command queued it only looks (timeout 0), so
        # replies are still read while submits keep coming.
        events = poller.poll(0 if self._commands else 20)
        self._sleeping = False
        ready = []
        for source, _ in events:
            if source == self._wake_read:
                self._drain_wake()
            else:
                ready.append(self._socket_index[source])
        return self._next_command(), ready

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _next_command(self):
        """The oldest queued command, or None (only this thread takes commands out)."""
        return self._commands.popleft() if self._commands else None

    def _loop(self) -> None:
        # The first heartbeat goes out one interval after the thread starts, never before the first
        # request: a server that refuses us answers one refused frame per peer per quarter second,
        # and it must be the request's (a client without the secret then fails at once, not after
        # a resend, 1 s later).
        last_heartbeat, next_resend_check = time.monotonic(), 0.0
        poller = self._socket_poller()
        while True:
            busy = poller is None and any(s.pending for s in self._servers)
            command, ready = self._wait(poller, busy)
            while command is not None:
                if command is _STOP:
                    return
                self._send_new(*command)
                command = self._next_command()
            for index in ready:  # only the sockets the poll saw readable
                transport = self._servers[index].transport
                while (frame := transport.recv(0)) is not None:
                    self._on_frame(index, frame)
            now = time.monotonic()
            if now >= next_resend_check:  # resends are due after retry_after_s: a scan every
                # quarter of it (at most 25 ms) is enough; at 5 ms a loaded loop scanned (a lock per
                # waiting request) on nearly every ack
                next_resend_check = now + self._resend_scan_s
                self._resend_due(now)
            if self.heartbeat_s is not None and now - last_heartbeat >= self.heartbeat_s:
                last_heartbeat = now
                self._heartbeat()

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
            server.pending[msg.seq] = _Pending(gather, slot, msg.type.value, msg, frame, now, now, self.retry_after_s)
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

    def _refused(self, server: _Server, code: str) -> None:
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
            if command is not _STOP:
                command[0].fail(error)
