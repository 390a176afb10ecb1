"""Where a replica group listens: on the address it advertises to its peers, not on every interface.

A group opens two listening sockets besides its torch.distributed world's: its store (a ``TCPStore`` its
rank 0 serves: the group's ranks and, when this group is first in a quorum, the quorum's gloo groups
rendezvous there) and torchft's Manager server (rank 0: it speaks to the Lighthouse for the group and
answers the other groups' recovery requests). torchft 0.2.0 binds the Manager server to ``[::]`` (every
interface) with no argument or variable to change it, and a ``TCPStore`` master binds every interface
too. Neither takes a secret, so here both bind the address the group advertises:

* the store listens on a socket bound here and handed over with ``TCPStore(master_listen_fd=...)``;
* the Manager server: ``manager_server_bound_to`` replaces the host part of the ``bind`` torchft passes
  to its ``ManagerServer`` while the Manager is built (torchft looks the class up in its module each
  time, and builds it only in the Manager's constructor).

The same hook sets how the Manager server retries the Lighthouse (``ReplicaGroups.lighthouse_retry_s``):
torchft 0.2.0 sleeps ``quorum_timeout / (quorum_retries + 1)`` after a failed quorum call and then
reconnects with an exponential backoff (0.1 s, x1.5, up to 10 s) for up to ``connect_timeout``, so with
its values the pause after an outage grew with both time-outs (16.7 s with a 5 s connect timeout).
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Iterator

__all__ = ["bind_address", "listening_socket", "manager_server_bound_to", "wait_for_lighthouse"]


def bind_address(host: str) -> str:
    """The IP address ``host`` (a name or an address) resolves to: what a socket binds."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as error:
        raise ValueError(f"the replica group's advertised host does not resolve: {host!r} ({error})") from None


def listening_socket(address: str) -> socket.socket:
    """A TCP socket listening on a free port of ``address`` (for ``TCPStore(master_listen_fd=...)``)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, 0))
    sock.listen(1024)
    return sock


@contextlib.contextmanager
def manager_server_bound_to(address: str, **overrides: Any) -> Iterator[None]:
    """While the block runs, torchft's Manager builds its ``ManagerServer`` on ``address`` (same port),
    with ``overrides`` (``connect_timeout``, ``quorum_retries``) in place of the Manager's own values."""
    import torchft.manager as manager_module

    original = manager_module.ManagerServer
    host = f"[{address}]" if ":" in address else address

    def bound(*args, bind: str, **kwargs):
        return original(*args, bind=f"{host}:{bind.rsplit(':', 1)[1]}", **{**kwargs, **overrides})

    manager_module.ManagerServer = bound
    try:
        yield
    finally:
        manager_module.ManagerServer = original


def wait_for_lighthouse(url: str, timeout_s: float) -> None:
    """Return once the Lighthouse at ``url`` accepts a TCP connection; ``TimeoutError`` after ``timeout_s``.
    (The Manager server then connects with its short Lighthouse timeout, which a Lighthouse started a
    moment after the group would otherwise fail.)"""
    from urllib.parse import urlsplit

    parts = urlsplit(url if "://" in url else f"http://{url}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((parts.hostname, parts.port or 80), timeout=1.0).close()
            return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"the Lighthouse at {url} accepted no connection in {timeout_s} s ({error})"
                ) from None
            time.sleep(0.1)
