"""Several hosts on one Linux machine: network namespaces joined by veth pairs to a bridge.

Each :class:`Host` is a network namespace with its own loopback and one interface, ``eth0``,
addressed ``198.18.0.<index + 1>/24`` (the benchmarking range, RFC 2544). The bridge lives
in a namespace of its own, so the machine's own namespace gains no interface, address or
route, and no namespace has a default route: traffic can reach only the other hosts.

Jobs start in a host with :meth:`Host.popen` (``ip netns exec``), exactly as they would be
started on separate machines. A host's link can be shaped (:meth:`Host.shape`: ``tc``),
cut (:meth:`Host.cut`), and its traffic read from the interface counters
(:meth:`Host.counters`). A whole host is lost with :meth:`Host.kill`.

:meth:`Cluster.close` (also on ``with`` exit, at interpreter exit, and for clusters left
behind by a process that died) kills every process in the namespaces and deletes them,
which removes their interfaces and the bridge with them.

Needs root (CAP_NET_ADMIN) and iproute2; :func:`unavailable_reason` says what is missing.

>>> with Cluster(2) as cluster:                                  # doctest: +SKIP
...     server = cluster.hosts[0].popen(["python", "-m", "http.server", "8000"])
...     cluster.hosts[1].run(["python", "-c", "import urllib.request as u; "
...                           "u.urlopen('http://198.18.0.1:8000')"])
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import time
import uuid

from .netns import _PREFIX, IFACE, SUBNET, _ip, _kill_namespace_processes, remove_stale_namespaces
from .netns_host import Host, LinkCounters, ShapingUnsupported


class ClusterUnavailable(RuntimeError):
    """This machine cannot build the cluster (no CAP_NET_ADMIN, no iproute2, ...)."""


def _has_net_admin() -> bool:
    try:
        with open("/proc/self/status") as status:
            caps = next(line for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return os.geteuid() == 0
    return bool(int(caps.split()[1], 16) & (1 << 12))  # CAP_NET_ADMIN is capability 12


def unavailable_reason() -> str | None:
    """Why no cluster can be built here, or None when it can."""
    if not os.path.isdir("/proc/sys/net") or os.uname().sysname != "Linux":
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    if not _has_net_admin():
        return "creating network namespaces needs CAP_NET_ADMIN (run as root)"
    return None


class Cluster:
    """``num_hosts`` hosts on one bridge; a context manager, closed at exit in any case."""

    def __init__(self, num_hosts: int = 2) -> None:
        if not 1 <= num_hosts <= 250:
            raise ValueError(f"num_hosts must be in [1, 250]. Received: num_hosts={num_hosts}")
        reason = unavailable_reason()
        if reason is not None:
            raise ClusterUnavailable(reason)
        remove_stale_namespaces()
        self.name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.bridge_netns = f"{self.name}-br"
        self.hosts = [Host(self, i) for i in range(num_hosts)]
        self._created: list[str] = []
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        try:
            self._add_netns(self.bridge_netns)
        except RuntimeError as exc:
            raise ClusterUnavailable(f"cannot create a network namespace: {exc}") from None
        _ip("-n", self.bridge_netns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_netns, "link", "set", "br0", "up")
        for host in self.hosts:
            self._add_netns(host.netns)
            # Both ends are created directly inside their namespaces, so nothing ever appears
            # in this machine's own namespace, and names cannot collide with a parallel run.
            _ip(
                "link",
                "add",
                IFACE,
                "netns",
                host.netns,
                "type",
                "veth",
                "peer",
                "name",
                host.port,
                "netns",
                self.bridge_netns,
            )
            _ip("-n", self.bridge_netns, "link", "set", host.port, "master", "br0")
            _ip("-n", self.bridge_netns, "link", "set", host.port, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", IFACE)
            _ip("-n", host.netns, "link", "set", IFACE, "up")

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_reachable(self, timeout: float = 10.0) -> None:
        """Wait until the links are up (a veth may take a moment to report carrier)."""
        deadline = time.monotonic() + timeout
        for host in self.hosts:
            while "LOWER_UP" not in _ip("-n", host.netns, "link", "show", IFACE).stdout:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{host} has no carrier after {timeout} s")
                time.sleep(0.05)

    def close(self) -> None:
        """Kill every process in the hosts and delete the namespaces (and with them the links)."""
        for name in self._created:
            _kill_namespace_processes(name)
        for host in self.hosts:
            for proc in host._procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for name in reversed(self._created):
            _ip("netns", "del", name, check=False)
        self._created.clear()
        atexit.unregister(self.close)


# Kept importable from here, where tests, fixtures and host_jobs have always found them.
__all__ = [
    "IFACE",
    "SUBNET",
    "Cluster",
    "ClusterUnavailable",
    "Host",
    "LinkCounters",
    "ShapingUnsupported",
    "remove_stale_namespaces",
    "unavailable_reason",
    "_ip",
]
