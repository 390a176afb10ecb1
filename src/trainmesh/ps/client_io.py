"""The PS client's I/O: who uses the sockets, and when.

Callers hand over ``[(server index, Message)]`` and get one future, done when every server
answered (``assemble(replies)`` builds its result on the thread that read the last reply).
ZeroMQ sockets are not thread-safe, so one lock (``_lock``) guards every socket and all request
state (client_requests.py); whichever thread holds it sends and reads:

- a caller that finds the lock free sends its request itself and reads any replies already
  there (no hand-off to another thread), and a caller waiting on a future reads its replies
  itself (``DrivenFuture``). A push used synchronously thus costs the round trip, not two
  thread wake-ups on top of it (each a scheduler round trip on a loaded machine);
- the I/O thread serves whatever no caller is waiting for: replies to pipelined requests,
  requests queued while the lock was busy, resends, heartbeats and timeouts. It sleeps in a poll
  on the sockets' file descriptors (``zmq.FD``, not the sockets: polling a socket is using it),
  and takes the lock when one becomes readable.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Callable

from .auth import resolve_secret
from .client_gather import DrivenFuture, Gather, ServerLink
from .client_requests import STOP as _STOP
from .client_requests import RequestBook
from .errors import PSError
from .protocol import Message
from .session import ClientSession

log = logging.getLogger(__name__)
# A waiting caller polls the sockets in slices this long (ms), so the I/O thread still gets the
# lock for resends, heartbeats and other threads' requests between them.
_DRIVE_SLICE_MS = 5


class ClientIO(RequestBook):
    """The I/O behind ``PSClient``; ``endpoints`` are addresses (connected here) or transports."""

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
        self._clock = clock
        self._servers = [ServerLink(name) for name in server_names]
        # Commands submitted while another thread held the lock, oldest first (whoever takes the
        # lock next sends them before anything else, so requests leave in submission order).
        self._commands: collections.deque = collections.deque()
        self._stats = {"resends": 0, "rejected_replies": 0, "requests": 0, "refusals": 0}
        self._closed = False
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._last_heartbeat = self._next_resend_check = 0.0
        # A byte here wakes the I/O thread (a command queued behind the lock, or close).
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        try:
            self._connect(list(endpoints), from_addresses)
        except BaseException:
            self._close_transports()
            for fd in (self._wake_read, self._wake_write):
                os.close(fd)
            raise
        self._thread = threading.Thread(target=self._run, name=f"ps-client-io-{sender}", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------------------------

    def submit(self, messages: list[tuple[int, Message]], assemble: Callable | None = None) -> Future:
        gather = Gather(len(messages), assemble, self.drive)
        if self._closed or self._failure is not None:
            gather.fail(self._closed_error())
        elif messages:
            if self._lock.acquire(blocking=False):
                try:  # sent from this thread, after anything queued before it
                    if self._run_commands():
                        self._send_new(gather, messages)
                        self._service(0)
                    else:
                        gather.fail(self._closed_error())
                finally:
                    self._lock.release()
            else:
                self._commands.append((gather, messages))
                self._wake()
        return gather.future

    def drive(self, future: DrivenFuture, timeout: float | None) -> float | None:
        """Read replies on this (waiting) thread until ``future`` is done, the lock is taken by
        another thread for long, or ``timeout`` passes; returns the timeout left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if threading.current_thread() is self._thread:
            return timeout
        while not future.done() and not self._closed and self._failure is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            slice_ms = _DRIVE_SLICE_MS if left is None else max(0, min(_DRIVE_SLICE_MS, int(left * 1000)))
            if self._lock.acquire(blocking=False):
                try:
                    self._service(slice_ms, future)
                finally:
                    self._lock.release()
            else:  # the I/O thread or another caller reads: wait for it to finish ours
                wait_futures((future,), timeout=slice_ms / 1000)
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):  # pipe full (a wake is pending anyway) or closed
            pass

    def _closed_error(self) -> PSError:
        return PSError(f"PS client of worker {self.sender} is closed" + (f": {self._failure}" if self._failure else ""))

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

    # -- with the lock held ---------------------------------------------------------------------

    def _connect(self, endpoints: list, from_addresses: bool) -> None:
        from .transport import ZmqClientTransport

        for server, endpoint in zip(self._servers, endpoints):
            server.transport = ZmqClientTransport(endpoint, self.identity) if from_addresses else endpoint
            if self.key is not None:
                server.session = ClientSession(self.key, self.sender)
                self._hello(server, time.monotonic())
        sockets = [getattr(s.transport, "socket", None) for s in self._servers]
        self._poller = self._fd_poller = None  # (transports that are not ZeroMQ: tests)
        if all(sock is not None for sock in sockets):
            import zmq

            # The sockets themselves, polled only by the lock's holder; and their file
            # descriptors, which the I/O thread polls without it.
            self._poller, self._fd_poller = zmq.Poller(), zmq.Poller()
            for sock in sockets:
                self._poller.register(sock, zmq.POLLIN)
                self._fd_poller.register(sock.getsockopt(zmq.FD), zmq.POLLIN)
            self._poller.register(self._wake_read, zmq.POLLIN)
            self._fd_poller.register(self._wake_read, zmq.POLLIN)

    def _next_command(self):
        return self._commands.popleft() if self._commands else None

    def _run_commands(self) -> bool:
        """Send the queued commands; False when close() queued its stop (left for the I/O thread)."""
        while (command := self._next_command()) is not None:
            if command is _STOP:
                if threading.current_thread() is not self._thread:
                    self._commands.appendleft(_STOP)
                    self._wake()
                return False
            self._send_new(*command)
        return True

    def _service(self, wait_ms: int, future: Future | None = None) -> bool:
        """Wait up to ``wait_ms`` for a reply (not past ``future`` done), send what was queued
        meanwhile, read every reply there is (each socket until it has none: the I/O thread's poll
        of the descriptors only sees new ones), then resends, timeouts and heartbeats when due.
        False when close() asked the I/O thread to stop."""
        if wait_ms and (future is None or not future.done()):
            if self._poller is not None:
                self._poller.poll(wait_ms)  # (a reply, or a wake byte: a command queued behind us)
            else:
                time.sleep(min(wait_ms, 1) / 1000)  # in-process transports: poll every millisecond
        self._drain_wake()
        if not self._run_commands():
            return False
        for index, server in enumerate(self._servers):
            transport = server.transport
            while (frame := transport.recv(0)) is not None:
                self._on_frame(index, frame)
        now = time.monotonic()
        if now >= self._next_resend_check:  # resends are due after retry_after_s: a scan every 5 ms is enough
            self._next_resend_check = now + 0.005
            self._resend_due(now)
        if self.heartbeat_s is not None and now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            self._heartbeat()
        return True

    def _close_transports(self) -> None:
        for server in self._servers:
            if server.transport is not None:
                server.transport.close()

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 - reported to every waiting caller
            log.exception("PS client I/O thread of worker %s failed", self.sender)
            self._failure = error
        finally:
            with self._lock:
                self._fail_all(self._failure or PSError(f"PS client of worker {self.sender} was closed"))
                self._close_transports()

    def _loop(self) -> None:
        while True:
            # Sleep without the lock until a socket descriptor or the wake pipe is readable (or,
            # without ZeroMQ, a millisecond while requests wait): then serve with the lock.
            busy = any(s.pending for s in self._servers)
            if self._fd_poller is not None:
                self._fd_poller.poll(0 if self._commands else (5 if busy else 20))
            elif not self._commands:
                select.select([self._wake_read], [], [], 0.001 if busy else 0.02)
            with self._lock:
                if not self._service(0):
                    return

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
