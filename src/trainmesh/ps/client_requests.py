"""What the PS client's I/O thread keeps for requests in flight, and what it does on a timer.

``Gather`` is one API call (its future and the replies it waits for), ``_Pending`` one request
sent to one server, ``_Server`` one connection's seqs and unanswered requests. ``RequestTimers``
is the part of the thread's loop that runs on the clock, not on a frame: resending an unanswered
request (same seq, the interval doubling up to 4x ``retry_after_s``), failing one past
``request_timeout_s``, resending a lost HELLO, and the heartbeats. It is apart from client_io.py
because that bookkeeping reads the same whatever the sockets do; the loop there calls it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import PSTimeoutError
from .protocol import Message, MessageType, encode
from .session import ClientSession


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


class RequestTimers:
    """The timed half of ``ClientIO``'s loop (see the module docstring); uses its ``_servers``,
    ``sender``, ``retry_after_s``, ``request_timeout_s``, ``_stats``, ``_clock`` and ``_seal``."""

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
