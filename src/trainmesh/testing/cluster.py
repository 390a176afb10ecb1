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
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import Mapping, Sequence

SUBNET = "198.18.0"
IFACE = "eth0"
# Namespace names carry the creating process's pid, so a later run can tell leftovers of a
# process that died (SIGKILL skips atexit) from a cluster another live process still uses.
_PREFIX = "tmc-"
_NAME_RE = re.compile(rf"^{_PREFIX}(\d+)-[0-9a-f]+-")


class ClusterUnavailable(RuntimeError):
    """This machine cannot build the cluster (no CAP_NET_ADMIN, no iproute2, ...)."""


class ShapingUnsupported(RuntimeError):
    """The kernel lacks the queueing discipline a shaping request needs (e.g. netem)."""


@dataclass(frozen=True)
class LinkCounters:
    """Bytes and packets through a host's interface since it was created."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: "LinkCounters") -> "LinkCounters":
        return LinkCounters(
            self.tx_bytes - other.tx_bytes,
            self.rx_bytes - other.rx_bytes,
            self.tx_packets - other.tx_packets,
            self.rx_packets - other.rx_packets,
        )


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(netns: str, sig: int = signal.SIGKILL) -> list[int]:
    pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces left by clusters whose creating process is gone; returns their names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class Host:
    """One machine of a :class:`Cluster`: a network namespace with ``eth0`` on the bridge."""

    def __init__(self, cluster: "Cluster", index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.netns = f"{cluster.name}-h{index}"
        self.address = f"{SUBNET}.{index + 1}"
        self.port = f"p{index}"  # the bridge's end of this host's veth pair
        self._procs: list[subprocess.Popen] = []
        self.loss_applied: float | None = None  # percent of packets dropped by shape(loss=...)

    def __repr__(self) -> str:
        return f"Host({self.index}, {self.address}, netns={self.netns!r})"

    def _argv(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd]

    def popen(
        self, cmd: Sequence[str], env: Mapping[str, str] | None = None, *, new_session: bool = True, **kwargs
    ) -> subprocess.Popen:
        """Start ``cmd`` in this host. ``env`` is *added* to this process's environment.

        The process gets a session of its own, so :meth:`Popen.send_signal` on its group
        (``os.killpg``) reaches its children too; :meth:`kill` reaches all of them anyway.
        ``new_session=False`` keeps it in the caller's session: where Linux autogroup is on, the
        scheduler shares the cores between sessions first, so processes of one job that are timed
        against each other (or against processes on loopback) belong in one session.
        """
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(self._argv(cmd), env=full_env, start_new_session=new_session, **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 120,
        check: bool = True,
        **kwargs,
    ) -> subprocess.CompletedProcess:
        """Run ``cmd`` in this host to completion (``subprocess.run`` semantics, output captured)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(
            self._argv(cmd), env={**os.environ, **(env or {})}, timeout=timeout, check=check, **kwargs
        )

    def kill(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process in this host (a machine losing power); returns their pids."""
        pids = _kill_namespace_processes(self.netns, sig)
        for proc in self._procs:
            if sig == signal.SIGKILL:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        return pids

    def cut(self) -> None:
        """Unplug this host's cable: the bridge's port goes down, the host's sockets stay open."""
        _ip("-n", self.cluster.bridge_netns, "link", "set", self.port, "down")

    def restore(self) -> None:
        """Plug the cable back in (undoes :meth:`cut`)."""
        _ip("-n", self.cluster.bridge_netns, "link", "set", self.port, "up")

    def shape(self, rate: str | None = None, delay: str | None = None, loss: float | None = None) -> None:
        """Shape this host's link in both directions: ``rate`` like ``"1gbit"``, ``delay`` like
        ``"5ms"`` (one way), ``loss`` in percent. Replaces any earlier shaping.

        Rate alone uses ``tbf``; delay or loss use ``netem``. Where the kernel has no netem,
        loss (with or without a rate) falls back to :meth:`_drop_some` (``htb`` + ``u32``), and
        delay raises :class:`ShapingUnsupported`. Egress is shaped on the host's ``eth0`` and
        ingress on the bridge's port toward the host, so neither side needs an ingress qdisc.
        """
        if rate is None and delay is None and loss is None:
            raise ValueError("shape() needs rate, delay or loss. Received: none of them")
        if loss is not None and not 0 <= loss <= 100:
            raise ValueError(f"loss is a percentage in [0, 100]. Received: loss={loss}")
        if delay is None and loss is None:
            # burst: at least one full-size frame per timer tick at this rate; latency bounds the queue.
            qdisc = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
        else:
            qdisc = ["netem", "limit", "100000"]
            qdisc += ["delay", delay] if delay else []
            qdisc += ["loss", f"{loss}%"] if loss else []
            qdisc += ["rate", rate] if rate else []
        try:
            self._apply(qdisc, f"rate={rate!r} delay={delay!r} loss={loss!r}")
            self.loss_applied = loss
        except ShapingUnsupported:
            if delay is not None or not loss:
                raise
            self.unshape()
            self._drop_some(loss, rate)

    def _apply(self, qdisc: list[str], what: str) -> None:
        for netns, dev in ((self.netns, IFACE), (self.cluster.bridge_netns, self.port)):
            done = _ip("netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc, check=False)
            if done.returncode != 0:
                if "unknown" in done.stderr.lower():
                    raise ShapingUnsupported(
                        f"this kernel has no `{qdisc[0]}` qdisc, needed for {what}: {done.stderr.strip()}"
                    )
                raise RuntimeError(f"tc on {netns}/{dev} failed: {done.stderr.strip()}")

    def _drop_some(self, loss: float, rate: str | None) -> None:
        """Packet loss without netem: IPv4 packets whose IP ID falls in ``round(loss% x 64)`` of
        64 buckets go to an ``htb`` class whose queue holds nothing (``pfifo limit 0``), so they
        are dropped; the rest pass (at ``rate``, if given).

        A connected TCP socket numbers its packets' IDs consecutively, and a retransmission gets
        a new ID, so this drops about ``loss``% of segments spread over time, like random loss.
        Packets with ID 0 (SYN-ACKs of a listening socket) are never dropped: the buckets are
        taken from the top. Loss is quantised to 1/64 (1.5625%); :attr:`loss_applied` says what
        was applied.
        """
        buckets = max(1, min(63, round(loss / 100 * 64)))
        line = rate or "100gbit"
        for netns, dev in ((self.netns, IFACE), (self.cluster.bridge_netns, self.port)):
            tc = ["netns", "exec", netns, "tc"]
            steps = [
                ["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1", "r2q", "100000"],
                ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", line],
                ["class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate", line],
                ["qdisc", "add", "dev", dev, "parent", "1:2", "handle", "2:", "pfifo", "limit", "0"],
            ]
            steps += [
                [
                    "filter",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    "1:",
                    "protocol",
                    "ip",
                    "prio",
                    "1",
                    "u32",
                    "match",
                    "u16",
                    str(63 - b),
                    "0x3f",
                    "at",
                    "4",
                    "flowid",
                    "1:2",
                ]
                for b in range(buckets)
            ]
            for step in steps:
                done = _ip(*tc, *step, check=False)
                if done.returncode != 0:
                    raise ShapingUnsupported(
                        f"cannot drop packets on {dev} (no netem, and htb/u32 failed: "
                        f"`tc {' '.join(step)}`: {done.stderr.strip()})"
                    )
        self.loss_applied = buckets / 64 * 100

    def unshape(self) -> None:
        """Remove any shaping from this host's link."""
        self.loss_applied = None
        for netns, dev in ((self.netns, IFACE), (self.cluster.bridge_netns, self.port)):
            _ip("netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def dropped_packets(self) -> int:
        """Packets this host's shaping has dropped so far, both directions: the ``dropped`` count
        ``tc -s`` reports for the root qdisc on the host's ``eth0`` and on the bridge's port toward
        it (a root counts its children's drops too, so only the root is read)."""
        total = 0
        for netns, dev in ((self.netns, IFACE), (self.cluster.bridge_netns, self.port)):
            shown = _ip("netns", "exec", netns, "tc", "-s", "qdisc", "show", "dev", dev, "root").stdout
            total += sum(int(n) for n in re.findall(r"dropped (\d+)", shown))
        return total

    def tcp_retransmits(self) -> int:
        """TCP segments retransmitted by this host's processes so far (its namespace's own count)."""
        lines = [
            line.split()
            for line in self.run(["cat", "/proc/net/snmp"], timeout=30).stdout.splitlines()
            if line.startswith("Tcp:")
        ]
        return int(lines[1][lines[0].index("RetransSegs")])

    def counters(self) -> LinkCounters:
        """This host's ``eth0`` counters, read from sysfs inside its namespace."""
        stats = f"/sys/class/net/{IFACE}/statistics"
        names = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        out = self.run(["cat", *(f"{stats}/{name}" for name in names)], timeout=30).stdout.split()
        return LinkCounters(*(int(v) for v in out))


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
