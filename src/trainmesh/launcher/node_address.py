"""Which address of this machine a node advertises to the others, and which interface holds it.

It exists apart from ``run.py`` because it asks the kernel (routes, interfaces) rather than the
command line; ``run.resolve_local_addr`` and ``run.worker_env`` use it.
"""

from __future__ import annotations

import ipaddress
import socket
import struct


def choose_local_addr(rdzv_endpoint: str) -> str:
    """The address of this machine's interface that routes to the rendezvous host.

    A UDP socket's ``connect()`` only asks the kernel for a route; no packet is sent.

    >>> choose_local_addr("127.0.0.1:29400")
    '127.0.0.1'
    """
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(rdzv_endpoint, default_port=29400)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ValueError(
            f"cannot resolve the rendezvous host {host!r} ({exc}). Received: --rdzv-endpoint {rdzv_endpoint}"
        ) from None
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(sockaddr)
            except OSError as exc:
                errors.append(f"{sockaddr[0]}: {exc}")
                continue
            return probe.getsockname()[0]
    raise ValueError(
        f"no route from this machine to the rendezvous host ({'; '.join(errors)}). "
        f"Received: --rdzv-endpoint {rdzv_endpoint}"
    )


def interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 ``address`` (Linux), or None."""
    try:
        import fcntl
    except ImportError:  # not a Unix
        return None
    try:
        address = socket.gethostbyname(address)
    except OSError:
        return None
    siocgifaddr = 0x8915  # <linux/sockios.h>: read an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a host name
