"""The PS client's I/O thread: owns every transport, numbers, resends and matches requests.

Callers hand over ``[(server index, Message)]`` and get one future, done when every server
answered (``assemble(replies)`` builds its result on this thread). Seqs start at 1 per server
(0 marks untracked heartbeats) and per client ``session``; each request carries ``floor``, the lowest seq still unanswered,
so the server can forget older ones. An unanswered request is resent unchanged (same seq)
after ``retry_after_s``, doubling up to 4x; after ``request_timeout_s`` it fails.

The handshake and the servers' refusals are in client_handshake.py; the per-request records and
what runs on a timer (resends, timeouts, heartbeats) in client_requests.py. This module keeps the
thread itself: the callers' queue, the socket loop, numbering new requests and matching replies.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from concurrent.futures import Future
from typing import Callable

from .ack_codec import read_ack
from .auth import rejection_code, rejection_in, resolve_secret
from .client_handshake import ClientHandshake
from .client_requests import Gather, RequestTimers, _Pending, _Server
from .errors import PSError, PSTimeoutError
from .protocol import Message, MessageType, ProtocolError, encode_parts, frame_flags
from .frame_decode import decode
from .session import ClientSession

log = logging.getLogger(__name__)
_STOP = object()


class ClientIO(ClientHandshake, RequestTimers):
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

    def _fail_all(self, error: BaseException) -> None:
        for server in self._servers:
            for pending in server.pending.values():
                pending.gather.fail(error)
            server.pending.clear()
        while (command := self._next_command()) is not None:
            if command is not _STOP:
                command[0].fail(error)
