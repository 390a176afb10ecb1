"""Byte transports between PS clients and servers: the interface and ZeroMQ's.

A transport moves opaque frames (see `protocol.py`); it knows nothing about messages.
Server side: ZeroMQ ROUTER (replies are routed by the client's identity); client side: DEALER.
Each transport object is used by ONE thread at a time (ZeroMQ sockets are not thread-safe; a
transport may be created in one thread and handed to another).
pyzmq is an optional extra: it is imported only when a ZeroMQ transport is created.
The in-memory and fault-injecting transports of tests are in `inprocess_transport.py`; the
raw ZeroMQ ceiling the benchmark compares pushes with is in `loopback_bandwidth.py`.
"""

from __future__ import annotations

import abc
import functools
import ipaddress
import time
from typing import NamedTuple

SECRET_ENV = "TRAINMESH_PS_SECRET"  # where servers and workers read the shared secret
# Frames at least this large travel without a copy (ZeroMQ takes or hands over the buffer);
# below it a copy is cheaper than the bookkeeping.
ZERO_COPY_MIN_BYTES = 65536


def frame_nbytes(data) -> int:
    """Bytes of a frame, or of a message given as a list of parts (see ``protocol.encode_parts``)."""
    return sum(memoryview(p).nbytes for p in data) if isinstance(data, (list, tuple)) else memoryview(data).nbytes


def joined(data) -> bytes:
    """One immutable frame from a frame or a list of parts (their concatenation)."""
    return b"".join(data) if isinstance(data, (list, tuple)) else bytes(data)


class _Transport:
    """Byte/message counters and idempotent close, shared by every transport."""

    def __init__(self) -> None:
        self.bytes_sent = self.bytes_received = self.messages_sent = self.messages_received = 0
        self._closed = False

    def _count_send(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.messages_sent += 1

    def _count_recv(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        self.messages_received += 1

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r}, identity={getattr(self, 'identity', None)!r})"

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release()

    def _release(self) -> None:
        """Free the underlying resources (called once by close)."""


class ClientTransport(_Transport, abc.ABC):
    """One client's connection to one server."""

    @abc.abstractmethod
    def send(self, data: bytes | list) -> None:
        """Best effort, never blocks for long: a frame can be lost (server down or restarting),
        so callers resend requests that were not acknowledged. ``data`` may be a list of parts
        (one message, their concatenation; ZeroMQ sends large parts without copying them)."""

    @abc.abstractmethod
    def recv(self, timeout_s: float | None) -> bytes | None:
        """Next frame from the server, or None after `timeout_s` (None: wait forever)."""


class ServerTransport(_Transport, abc.ABC):
    """A server endpoint receiving frames from many clients, replying by peer identity."""

    # True only for transports no other process can reach (tests' in-process hub): a server
    # on any other transport must authenticate its peers (see auth.py).
    in_process: bool = False

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The endpoint clients connect to (the real port when bound to port 0)."""

    @abc.abstractmethod
    def recv(self, timeout_s: float | None) -> tuple[bytes, bytes] | None:
        """Next `(peer, frame)`, or None after `timeout_s` (None: wait forever). A message sent as
        several parts arrives as their list (``frame_decode.decode`` reads either)."""

    @abc.abstractmethod
    def send(self, peer: bytes, data: bytes | list) -> None:
        """Reply to `peer`; silently dropped if that peer is gone (it will resend)."""


def normalize_address(address: str) -> str:
    """`"host:port"` -> `"tcp://host:port"`; checks tcp://HOST:PORT, ipc:// and inproc:// URLs."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"address must be a non-empty string like 'tcp://127.0.0.1:5555', got {address!r}")
    address = address if "://" in address else f"tcp://{address}"
    scheme = address.split("://", 1)[0]
    if scheme not in ("tcp", "ipc", "inproc"):
        raise ValueError(f"unsupported transport in {address!r}; use tcp://, ipc:// or inproc://")
    host, sep, port = _tcp_host_port(address) if scheme == "tcp" else ("-", ":", "0")
    if not sep or not host or not (port == "*" or port.isdigit()):
        raise ValueError(f"tcp address must look like 'tcp://HOST:PORT', got {address!r}")
    return address


def _tcp_host_port(address: str) -> tuple[str, str, str]:
    return address[len("tcp://") :].rpartition(":")


def check_bind_address(address: str, secret: bytes | str | None) -> str:
    """Refuse to expose an unauthenticated server: non-loopback binds need a secret.

    Returns the normalized address."""
    address = normalize_address(address)
    if address.startswith("tcp://") and not secret:  # ipc:// and inproc:// are local anyway
        host = _tcp_host_port(address)[0].strip("[]")
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False  # a hostname or interface name: might be reachable from outside
        if not loopback:
            raise ValueError(
                f"refusing to bind the parameter server to {address!r} without a secret: only "
                f"loopback addresses (127.0.0.0/8, ::1, localhost) may run unauthenticated; "
                f"set {SECRET_ENV} or pass secret="
            )
    return address


def _zmq_socket(kind: str, address: str, **options):
    """(zmq module, new socket); pyzmq is imported only here so it stays an optional extra."""
    try:
        import zmq
    except ImportError as exc:
        raise ImportError("the parameter server's ZeroMQ transport needs pyzmq: pip install 'trainmesh[ps]'") from exc
    sock = zmq.Context.instance().socket(getattr(zmq, kind))
    # LINGER 0: close never waits for unsent frames (a dead peer must not hang shutdown).
    for name, value in {"LINGER": 0, "IPV6": int(address.startswith("tcp://[")), **options}.items():
        sock.setsockopt(getattr(zmq, name), value)
    return zmq, sock


class _Flags(NamedTuple):
    events: int
    pollin: int
    rcvmore: int
    sndmore: int
    noblock_sndmore: int
    noblock: int


@functools.cache
def _flags(zmq) -> _Flags:
    """pyzmq's flags as plain ints: its enum members build a new enum object at every ``|`` and
    ``&``, microseconds per message on the hot path."""
    return _Flags(
        int(zmq.EVENTS),
        int(zmq.POLLIN),
        int(zmq.RCVMORE),
        int(zmq.SNDMORE),
        int(zmq.NOBLOCK | zmq.SNDMORE),
        int(zmq.NOBLOCK),
    )


def _poll_ms(timeout_s: float | None) -> int | None:
    return None if timeout_s is None else max(0, int(timeout_s * 1000))


def _readable(socket, zmq, timeout_ms: int | None) -> bool:
    """Whether a whole message can be received now, after waiting up to ``timeout_ms`` (None:
    forever). A message already queued needs no poll; only the socket's owner thread receives,
    so a True answer stays true until it does."""
    flags = _flags(zmq)
    if socket.get(flags.events) & flags.pollin:
        return True
    return timeout_ms != 0 and bool(socket.poll(timeout_ms, flags.pollin))


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class ZmqServerTransport(ServerTransport):
    """ROUTER socket bound to `bind` (port 0 or '*': a free port; see `address`).

    `secret` is only used to allow non-loopback binds; frames are authenticated by protocol.py.
    A taken port is retried for `bind_timeout_s` (a restarted server's old listener may linger)."""

    def __init__(
        self, bind: str = "tcp://127.0.0.1:0", secret: bytes | str | None = None, bind_timeout_s: float = 2.0
    ) -> None:
        super().__init__()
        bind = check_bind_address(bind, secret)
        if bind.startswith("tcp://") and _tcp_host_port(bind)[2] == "0":
            bind = bind[: bind.rindex(":")] + ":*"  # ZeroMQ's "any free port"
        # ROUTER_HANDOVER: a restarted worker reconnecting with the same identity takes over the
        # old route instead of being ignored while the dead connection lingers.
        self._zmq, self._socket = _zmq_socket("ROUTER", bind, ROUTER_HANDOVER=1)
        try:
            self._bind(bind, time.monotonic() + bind_timeout_s)
        except self._zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise OSError(f"cannot bind the parameter server to {bind!r}: {exc}") from exc
        self._address = self._socket.getsockopt_string(self._zmq.LAST_ENDPOINT)

    def _bind(self, bind: str, deadline: float) -> None:
        # ZeroMQ closes a listener asynchronously, so a server restarted on the same port
        # may find it still taken for a moment: retry until the deadline.
        while True:
            try:
                return self._socket.bind(bind)
            except self._zmq.ZMQError as exc:
                if exc.errno != self._zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    @property
    def address(self) -> str:
        return self._address

    @property
    def socket(self):
        """The ROUTER socket, for a ``zmq.Poller`` in the thread that owns this transport."""
        return self._socket

    def recv(self, timeout_s: float | None) -> tuple[bytes, bytes | memoryview] | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            # A busy server finds the next request queued: no poll. Asking EVENTS first costs
            # less than a NOBLOCK receive that fails (pyzmq raises an exception for it).
            if not _readable(self._socket, self._zmq, _poll_ms(_remaining(deadline))):
                return None
            frames = self._socket.recv_multipart(copy=False)
            if len(frames) >= 2:
                # A large frame is handed over as a read-only view of ZeroMQ's buffer (no copy);
                # the server decodes it without copying either. Several parts come as a list.
                data = [f.buffer if len(f) >= ZERO_COPY_MIN_BYTES else f.bytes for f in frames[1:]]
                self._count_recv(sum(len(f) for f in frames[1:]))
                return frames[0].bytes, data[0] if len(data) == 1 else data
            # Otherwise not a DEALER client of ours (nothing after the identity): skip it.

    def send(self, peer: bytes, data: bytes | list) -> None:
        self._check_open()
        if type(data) is bytearray or type(data) is bytes:
            # One frame (every reply the server encodes): two sends, without send_multipart's
            # per-part checks. A small frame (an ack) is copied, which costs less than handing
            # it over; a large one (a pull reply) is handed to ZeroMQ without a memcpy.
            nbytes = len(data)
            self._socket.send(peer, _flags(self._zmq).sndmore)
            self._socket.send(data, copy=nbytes < ZERO_COPY_MIN_BYTES)
            self._count_send(nbytes)
            return
        # copy=False hands large buffers to ZeroMQ without a memcpy (pyzmq still copies parts
        # under its copy_threshold, 64 KiB by default, where that is cheaper).
        parts = list(data) if isinstance(data, (list, tuple)) else [data]
        self._socket.send_multipart([peer, *parts], copy=False)
        self._count_send(frame_nbytes(parts))

    def _release(self) -> None:
        self._socket.close(linger=0)


class ZmqClientTransport(ClientTransport):
    """DEALER socket connected to `address`; ZeroMQ reconnects by itself if the server restarts."""

    def __init__(self, address: str, identity: bytes) -> None:
        super().__init__()
        if not isinstance(identity, bytes) or not identity or identity[0] == 0:
            # ZeroMQ reserves identities starting with a zero byte.
            raise ValueError(f"identity must be non-empty bytes not starting with b'\\x00', got {identity!r}")
        self.address, self.identity = normalize_address(address), identity
        self._zmq, self._socket = _zmq_socket(
            "DEALER", self.address, IDENTITY=identity, RECONNECT_IVL=50, RECONNECT_IVL_MAX=1000
        )
        self._socket.connect(self.address)
        self.dropped_queue_full = 0

    def send(self, data: bytes | list) -> None:
        self._check_open()
        parts = data if isinstance(data, (list, tuple)) else [data]
        sock, zmq = self._socket, self._zmq
        flags = _flags(zmq)
        try:
            # NOBLOCK: with the server gone for long, the queue fills (SNDHWM messages); blocking
            # there would hang the caller, so the message is dropped and counted instead (a
            # multipart message is queued whole or not at all: only its first part can meet the
            # high-water mark). copy=False: large parts leave from the caller's memory (pyzmq
            # copies those under its 64 KiB copy_threshold). The parts go one send each, as
            # send_multipart would, without its per-part type checks (parts are buffers here).
            for part in parts[:-1]:
                sock.send(part, flags.noblock_sndmore, copy=False)
            sock.send(parts[-1], flags.noblock, copy=False)
        except zmq.Again:
            self.dropped_queue_full += 1
            return
        self._count_send(frame_nbytes(parts))

    @property
    def socket(self):
        """The DEALER socket, for a ``zmq.Poller`` in the thread that owns this transport."""
        return self._socket

    def recv(self, timeout_s: float | None) -> bytes | None:
        if not _readable(self._socket, self._zmq, _poll_ms(timeout_s)):
            return None
        # Replies are one frame (an ack, a pull reply): read it alone, the rest only if there is more.
        data = self._socket.recv()
        if self._socket.get(_flags(self._zmq).rcvmore):  # (RCVMORE; the rcvmore attribute costs more)
            data = [data, *self._socket.recv_multipart()]
            self._count_recv(frame_nbytes(data))
        else:
            self._count_recv(len(data))
        return data

    def _release(self) -> None:
        self._socket.close(linger=0)
