"""``Host``: one machine of a cluster, a network namespace with ``eth0`` on the bridge: starting
jobs in it, losing it, cutting, shaping and counting its link.

It exists apart from ``cluster.py``, which builds and removes the namespaces and the bridge, because
a test works with one host at a time: what can be done to a machine reads here on its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from .netns import IFACE, SUBNET, _ip, _kill_namespace_processes

if TYPE_CHECKING:
    from .cluster import Cluster


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
