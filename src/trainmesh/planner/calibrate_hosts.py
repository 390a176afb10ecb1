"""The link between two hosts, measured: ``trainmesh plan --calibrate --host-link RATE``.

Loopback (``calibrate.calibrate_collectives``) is what processes on one machine share. Between
machines the link is slower and its alpha larger, and a plan that crosses hosts has to be priced
with it. Here the hosts are two network namespaces of this machine (``trainmesh.testing.cluster``,
198.18.0.0/24, no default route), their links shaped to ``RATE`` in both directions (``tbf``), and
one gloo process in each (``testing.host_jobs.run_on_hosts``): the same collectives as on loopback
(all-reduce, all-gather, reduce-scatter, a point-to-point ping-pong), timed the same way
(``calibrate._collective_times``),
each kind fitted on its own against the wire bytes gloo's algorithms send: alpha from the smallest
message, beta from the messages past tbf's burst (``fit_shaped``).

The result becomes the plan's inter-node link (``with_host_link``): an axis whose process group spans
hosts is priced with it, one inside a host with loopback. The namespace hosts share this machine's
cores, so the processes of every host count as sharing them (``Hardware.nodes_share_cores``).

Needs root (CAP_NET_ADMIN) and iproute2; where they are missing, ``measure_host_link`` raises
``ClusterUnavailable`` with the reason.
"""

from __future__ import annotations

from dataclasses import replace

from .calibrate import KINDS, SIZES
from .hardware import Hardware, Link

# Up to 32 MiB: an FSDP2 unit's gather or a DP bucket crosses the link in messages of 10-40 MB, and a
# shaped link's tbf passes its first 256 KB at line speed, so the large sizes are the ones that set beta.
HOST_SIZES = SIZES + [2**25]
BULK = 2**20


def measure_host_link(
    rate: str = "1gbit", *, repeats: int = 5, sizes: list[int] | None = None, kinds: tuple = KINDS, timeout: float = 300
) -> tuple[Link, tuple, tuple]:
    """``(Link, ((kind, alpha, beta), ...), ((kind, ((wire bytes, seconds), ...)), ...))`` of two namespace
    hosts whose links are shaped to ``rate``: the summary line, each kind's fit, each kind's measured curve."""
    times = time_host_link(rate, repeats=repeats, sizes=sizes, kinds=kinds, timeout=timeout)
    return (*fit_host_link(rate, times), curves(times))


def curves(times: dict[str, dict[int, float]]) -> tuple:
    """Each kind's measured seconds per call against the wire bytes of the call (what the plan prices by)."""
    from .collectives import wire_bytes

    return tuple(
        (kind, tuple((wire_bytes(kind, float(s), 2, "gloo"), t) for s, t in sorted(by.items())))
        for kind, by in times.items()
    )


def fit_shaped(times: dict[int, float], wire_factor: float = 1.0) -> tuple[float, float]:
    """``(alpha, beta)`` of a shaped link: alpha the smallest message's time, beta the slope through it that
    fits the sizes past tbf's burst (``BULK``) in relative error.

    A shaped link has two regimes: tbf passes a burst (256 KB) at line speed, so messages within it see
    only latency, and bulk transfers see the rate. One straight line through all sizes
    (``calibrate.fit_alpha_beta``) takes its slope from the small, burst-fed messages and prices a
    30 MB gather at 0.6x its time; the plan's traffic is bulk (FSDP2 units and DDP buckets of MBs).
    """
    smallest = min(times)
    alpha = times[smallest]
    bulk = {s: t for s, t in times.items() if s >= BULK} or times
    xs = {s: wire_factor * s for s in bulk}
    # least squares of (alpha + x / beta - t) / t over the bulk sizes, alpha fixed: closed form in 1 / beta
    per_byte = sum(xs[s] * (t - alpha) / t**2 for s, t in bulk.items()) / sum(
        xs[s] ** 2 / t**2 for s, t in bulk.items()
    )
    return alpha, 1.0 / max(per_byte, 1e-15)


def fit_host_link(rate: str, times: dict[str, dict[int, float]]) -> tuple[Link, tuple]:
    """The link (all-reduce's figures) and each kind's own ``(kind, alpha, beta)``, fitted by ``fit_shaped``."""
    from .collectives import wire_bytes

    costs = tuple((kind, *fit_shaped(by, wire_bytes(kind, 1.0, 2, "gloo"))) for kind, by in times.items())
    alpha, beta = next(((a, b) for k, a, b in costs if k == "all_reduce"), costs[0][1:])
    return Link(f"hosts at {rate}", alpha, beta), costs


def time_host_link(
    rate: str, *, repeats: int = 5, sizes: list[int] | None = None, kinds: tuple = KINDS, timeout: float = 300
) -> dict[str, dict[int, float]]:
    """Median seconds of one call of each kind per full-buffer size, between two namespace hosts at ``rate``
    (one process in each, ``testing.host_jobs.run_on_hosts``)."""
    from trainmesh.testing.host_jobs import run_on_hosts

    return run_on_hosts(
        "trainmesh.planner.calibrate:_collective_times",
        (sizes or HOST_SIZES, repeats, kinds),
        2,
        rate=rate,
        timeout=timeout,
    )[0]


def with_host_link(hardware: Hardware, link: Link, costs: tuple, measured: tuple, processes_per_host: int) -> Hardware:
    """``hardware`` as a cluster of namespace hosts of ``processes_per_host`` processes each, joined by ``link``:
    the inter-node link, each kind's fit and measured curve (``measured``, which prices the calls), with
    every host's processes sharing this machine's cores."""
    per_kind = "; ".join(f"{kind} alpha {a * 1e6:.0f} us, beta {b / 1e6:.0f} MB/s" for kind, a, b in costs)
    return replace(
        hardware,
        inter=link,
        inter_collective_costs=costs,
        inter_collective_curves=measured,
        devices_per_node=processes_per_host,
        nodes_share_cores=True,
        inter_link_per_node=True,
        source=f"{hardware.source}; between hosts: network-namespace hosts of this machine, "
        f"{processes_per_host} process(es) each, {link.name} (measured: {per_kind}; calls priced on each "
        "kind's measured curve)",
    )
