"""Transports for tests and failure drills: servers and clients in threads of one process
(``InProcessHub``), and a wrapper that loses, duplicates or delays a client's frames
(``FaultInjectingTransport``, over any client transport, ZeroMQ's too).

The hub may be shared by many threads, each owning its own transports (see `transport.py`).
"""

from __future__ import annotations

import queue
import random
import threading
import time

from .transport import ClientTransport, ServerTransport, _remaining, joined


class InProcessHub:
    """In-memory stand-in for ZeroMQ in unit tests: servers and clients in threads of one process.

    Like ZeroMQ: a client may send before its server exists (frames queue), frames queued to a
    closed server are lost, replies to an unknown peer are dropped, and a server created again
    under the same name is reached by the existing clients."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[str, queue.Queue] = {}  # server name -> (peer, frame)
        self._outboxes: dict[tuple[str, bytes], queue.Queue] = {}  # (server name, peer) -> frame
        self._bound: set[str] = set()

    def server(self, name: str) -> InProcessServerTransport:
        with self._lock:
            if name in self._bound:
                raise ValueError(f"in-process server {name!r} is already bound")
            self._bound.add(name)
        return InProcessServerTransport(self, name)

    def client(self, name: str, identity: bytes) -> InProcessClientTransport:
        if not isinstance(identity, bytes) or not identity:
            raise ValueError(f"identity must be non-empty bytes, got {identity!r}")
        replies: queue.Queue = queue.Queue()
        with self._lock:
            self._outboxes[(name, identity)] = replies  # a reconnect under the same identity takes over
        return InProcessClientTransport(self, name, identity, replies)

    def _inbox(self, name: str) -> queue.Queue:
        with self._lock:
            return self._inboxes.setdefault(name, queue.Queue())


def _queue_get(box: queue.Queue, timeout_s: float | None):
    try:
        return box.get(timeout=timeout_s)  # timeout 0 polls, None waits forever
    except queue.Empty:
        return None


class InProcessServerTransport(ServerTransport):
    in_process = True

    def __init__(self, hub: InProcessHub, name: str) -> None:
        super().__init__()
        self._hub, self._name, self._inbox = hub, name, hub._inbox(name)

    @property
    def address(self) -> str:
        return self._name

    def recv(self, timeout_s: float | None) -> tuple[bytes, bytes] | None:
        item = _queue_get(self._inbox, timeout_s)
        if item is not None:
            self._count_recv(len(item[1]))
        return item

    def send(self, peer: bytes, data: bytes | list) -> None:
        self._check_open()
        data = joined(data)  # snapshot: the receiver must not see later changes to a mutable buffer
        with self._hub._lock:
            box = self._hub._outboxes.get((self.address, peer))
        if box is not None:
            box.put(data)
        self._count_send(len(data))

    def _release(self) -> None:
        with self._hub._lock:  # frames still queued for this server are lost, as with ZeroMQ
            self._hub._bound.discard(self._name)
            if self._hub._inboxes.get(self._name) is self._inbox:
                del self._hub._inboxes[self._name]


class InProcessClientTransport(ClientTransport):
    def __init__(self, hub: InProcessHub, name: str, identity: bytes, replies: queue.Queue) -> None:
        super().__init__()
        self._hub, self.address, self.identity, self._replies = hub, name, identity, replies

    def send(self, data: bytes | list) -> None:
        self._check_open()
        data = joined(data)
        self._hub._inbox(self.address).put((self.identity, data))
        self._count_send(len(data))

    def recv(self, timeout_s: float | None) -> bytes | None:
        data = _queue_get(self._replies, timeout_s)
        if data is not None:
            self._count_recv(len(data))
        return data

    def _release(self) -> None:
        with self._hub._lock:
            if self._hub._outboxes.get((self.address, self.identity)) is self._replies:
                del self._hub._outboxes[(self.address, self.identity)]


class FaultInjectingTransport(ClientTransport):
    """Wraps a client transport and loses, duplicates or delays frames at random (seeded).

    `dropped_sends`, `dropped_recvs`, `duplicated_sends` count what it did; the byte counters
    are the inner transport's (what really went over the wire)."""

    def __init__(
        self,
        inner: ClientTransport,
        drop_send: float = 0.0,
        drop_recv: float = 0.0,
        duplicate_send: float = 0.0,
        delay_s: tuple[float, float] = (0.0, 0.0),
        seed: int | None = None,
    ) -> None:
        if not isinstance(inner, ClientTransport):
            raise TypeError(f"inner must be a ClientTransport, got {type(inner).__name__}")
        self.inner, self.address = inner, getattr(inner, "address", None)
        for name, value in (("drop_send", drop_send), ("drop_recv", drop_recv), ("duplicate_send", duplicate_send)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
        self.drop_send, self.drop_recv, self.duplicate_send = drop_send, drop_recv, duplicate_send
        low, high = delay_s
        if not 0.0 <= low <= high:
            raise ValueError(f"delay_s must be (low, high) with 0 <= low <= high, got {delay_s!r}")
        self.delay_s = (float(low), float(high))
        self._rng = random.Random(seed)
        self.dropped_sends = self.dropped_recvs = self.duplicated_sends = 0
        self._closed = False

    bytes_sent = property(lambda self: self.inner.bytes_sent)
    bytes_received = property(lambda self: self.inner.bytes_received)
    messages_sent = property(lambda self: self.inner.messages_sent)
    messages_received = property(lambda self: self.inner.messages_received)

    def send(self, data: bytes) -> None:
        # Draw all random numbers up front so the fault sequence depends only on the seed.
        drop, dup = self._rng.random() < self.drop_send, self._rng.random() < self.duplicate_send
        delay = self._rng.uniform(*self.delay_s)
        if drop:
            self.dropped_sends += 1
            return
        if delay:
            time.sleep(delay)
        self.inner.send(data)
        if dup:
            self.duplicated_sends += 1
            self.inner.send(data)

    def recv(self, timeout_s: float | None) -> bytes | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            data = self.inner.recv(_remaining(deadline))
            if data is None or self._rng.random() >= self.drop_recv:
                return data
            self.dropped_recvs += 1  # lost in transit: keep waiting for the next frame

    def _release(self) -> None:
        self.inner.close()
