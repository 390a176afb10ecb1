"""Hardware figures for step time: a device's FLOP rate and an alpha-beta model of each link.

A collective on an axis costs ``calls * alpha + wire_bytes / beta`` (``collectives.wire_bytes``,
ring algorithms), with the link's alpha and beta, or the collective kind's own where calibration
measured each kind (``collective_costs``). An axis uses the intra-node link when its whole process
group fits in one node (``stride * size <= devices_per_node``, ranks numbered row-major as torchrun does), else the
inter-node link, whose per-device bandwidth is the bottleneck of a ring that crosses nodes. Where a
node has one such link for all its processes (``inter_link_per_node``), the rings of every group
that crosses it share it (``link_sharers``).

Figures come from one of two places, and the output names which:

* ``published``: vendor datasheet numbers (``HARDWARE["h100"]``: 989 TFLOP/s dense bf16,
  NVLink 4 at 900 GB/s bidirectional = 450 GB/s each way, one 400 Gb/s NDR NIC per GPU = 50 GB/s).
  Peak numbers: a plan on them is a best case; alphas (5 us NVLink, 10 us InfiniBand) are the
  order of NCCL's small-message latency, an assumption, not a datasheet figure;
* ``calibrated``: measured on this machine by ``trainmesh plan --calibrate`` (``calibrate.py``).

>>> h = HARDWARE["h100"]
>>> h.link_for(stride=1, size=8).name, h.link_for(stride=8, size=16).name
('nvlink', 'infiniband')
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from .collectives import CollectiveLog, wire_bytes


@dataclass(frozen=True)
class Link:
    name: str
    alpha: float  # seconds per call
    beta: float  # bytes per second, one direction, per device


@dataclass(frozen=True)
class Hardware:
    name: str
    source: str  # "published: ..." or "calibrated on <host> ..."
    flops: float  # FLOP/s per device at the planned precision
    devices_per_node: int
    intra: Link
    inter: Link
    memory: int | None = None
    # Per-op pricing (``op_costs.price``): an op costs max(flops / rate, bytes / bandwidth) + overhead.
    memory_bandwidth: float | None = None  # bytes/s a memory-bound op moves (None: not priced)
    flops_curve: tuple = ()  # ((flops of one matmul, FLOP/s it gets), ...), ascending
    bandwidth_curve: tuple = ()  # ((bytes one op moves, bytes/s it gets), ...), ascending
    op_overhead: float = 0.0  # seconds every dispatched op costs besides its work
    dtensor_op_overhead: float = 0.0  # extra seconds of an op on DTensors (sharding propagation)
    # A CPU host: the cores its processes share (None: each device computes on its own). With more
    # processes than cores each runs at cores/processes of its rate, and communication (memory copies
    # on the same cores) cannot hide behind compute.
    cores: int | None = None
    # Others' processes competing for the host's cores while it was calibrated (calibrate_ops): they take
    # their share of the cores, and the per-op figures were measured with that share.
    external_load: float = 0.0
    # Measured (calibrate_cores): ((P, slowdown), ...), how much slower each of P processes of one job
    # runs at once on this host than one alone. When present it replaces the core-count formula.
    contention_curve: tuple = ()
    backend: str = "nccl"  # which collective algorithms price the wire (collectives.wire_bytes)
    # Measured (calibrate.calibrate_collectives): ((kind, alpha, beta), ...) of each collective kind on the
    # intra-node link, where one kind's figures do not price another (gloo's all-gather and reduce-scatter
    # copy and set up more than its all-reduce). A kind not in it uses its link's alpha and beta.
    collective_costs: tuple = ()
    # Measured (calibrate_ops.measure_fsdp_overhead): seconds of FSDP2's own work (hooks, bookkeeping) per
    # all-gather or reduce-scatter call of a unit, besides the ops it dispatches and the collective itself.
    fsdp_call_overhead: float = 0.0
    # Measured (calibrate_op_kinds.measure_op_kind_curves): ((kind, ((size, rate), ...)), ...) of the op kinds the
    # roofline misprices (``op_costs.op_kind``): attention by FLOPs (FLOP/s), arithmetic-bound element-wise
    # ops by bytes moved (bytes/s). A kind not in it is priced by the matmul curve or the bandwidth curve.
    op_kind_curves: tuple = ()
    # Measured (calibrate_hosts.measure_host_link): ((kind, alpha, beta), ...) on the inter-node link, and
    # ((kind, ((wire bytes of one call, seconds), ...)), ...): a shaped link's time per call is not a line
    # (bursts pass at line speed, bulk transfers slow as queues fill), so where a kind has a curve, calls of
    # it across nodes are priced on the curve at their mean size instead of by alpha and beta.
    inter_collective_costs: tuple = ()
    inter_collective_curves: tuple = ()
    # The nodes are emulated on one machine (network-namespace hosts, calibrate_hosts): every process of
    # the job shares its cores, whichever node it is on.
    nodes_share_cores: bool = False
    # One link between nodes per node, which the flows of all its processes share (the namespace hosts: one
    # shaped veth each). False: each device has its own way out (published figures: one NIC per GPU).
    inter_link_per_node: bool = False

    def link_for(self, *, stride: int, size: int) -> Link:
        return self.intra if stride * size <= self.devices_per_node else self.inter

    def alpha_beta(self, kind: str, link: Link) -> tuple[float, float]:
        """(alpha, beta) of one ``kind`` of collective on ``link``: the kind's own measured figures on that
        link where calibrated, else the link's."""
        for on, costs in ((self.intra, self.collective_costs), (self.inter, self.inter_collective_costs)):
            if link == on:
                for measured, alpha, beta in costs:
                    if measured == kind:
                        return alpha, beta
        return link.alpha, link.beta

    def collective_seconds(self, kind: str, link: Link, calls: int, wire: float) -> float:
        """Seconds of ``calls`` collectives of ``kind`` that put ``wire`` bytes on ``link`` in all."""
        if link == self.inter and calls > 0:
            curve = dict(self.inter_collective_curves).get(kind)
            if curve:
                return calls * _interpolate(curve, wire / calls)
        alpha, beta = self.alpha_beta(kind, link)
        return calls * alpha + wire / beta

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Hardware":
        data = dict(data)
        data["intra"], data["inter"] = Link(**data["intra"]), Link(**data["inter"])
        for key in ("flops_curve", "bandwidth_curve", "contention_curve", "collective_costs", "inter_collective_costs"):
            data[key] = tuple(tuple(point) for point in data.get(key, ()))
        for key in ("op_kind_curves", "inter_collective_curves"):
            data[key] = tuple((kind, tuple(tuple(point) for point in curve)) for kind, curve in data.get(key, ()))
        return cls(**data)

    def processes_per_node(self, world_size: int) -> int:
        """The job's processes that share one machine's cores (all of them where the nodes are emulated on one)."""
        return world_size if self.nodes_share_cores else min(world_size, self.devices_per_node)

    def cpu_share(self, processes: int) -> float:
        """The fraction of a core each of ``processes`` gets on a CPU host shared with its external load."""
        if not self.cores:
            return 1.0
        return min(1.0, self.cores / (processes + self.external_load))

    def contention(self, world_size: int) -> float:
        """How much slower each process computes than the (single-process) calibration measured, because
        the job's processes and the host's other load share its cores (1.0 on devices): the measured
        curve where there is one, else the core count's fair share."""
        if self.contention_curve:
            from .calibrate_cores import slowdown_at

            return slowdown_at(self.contention_curve, self.processes_per_node(world_size))
        return self.cpu_share(1) / self.cpu_share(self.processes_per_node(world_size))

    def shares_cores(self, world_size: int) -> bool:
        """Whether the job's processes on a CPU host compete for its cores (then CPU time bounds the step)."""
        if not self.cores:
            return False
        if self.contention_curve:
            return self.contention(world_size) > 1.0
        return self.processes_per_node(world_size) + self.external_load > self.cores

    def overlaps(self, world_size: int) -> bool:
        """Whether communication can run beside compute: on devices (copy engines, NCCL's own SMs)
        yes; on a CPU host only while a core is left over for gloo's threads."""
        return self.cores is None or self.processes_per_node(world_size) < self.cores

    @classmethod
    def load(cls, path: str) -> "Hardware":
        with open(path) as f:
            return cls.from_dict(json.load(f))


HARDWARE = {
    "h100": Hardware(
        name="h100",
        source="published: NVIDIA H100 SXM5 datasheet (989 TFLOP/s dense bf16, NVLink 900 GB/s "
        "bidirectional, HBM3 3.35 TB/s), 400 Gb/s NDR InfiniBand per GPU; alphas assumed (5 us / 10 us); "
        "kernel launches assumed hidden by asynchronous execution (no per-op overhead)",
        flops=989e12,
        devices_per_node=8,
        intra=Link("nvlink", 5e-6, 450e9),
        inter=Link("infiniband", 10e-6, 50e9),
        memory=80 * 10**9,
        memory_bandwidth=3.35e12,
    ),
}


def resolve_hardware(value: str | Hardware | None) -> Hardware:
    if isinstance(value, Hardware):
        return value
    if value is None:
        return HARDWARE["h100"]
    if value == "calibrated":
        from .calibrate import cached_calibration

        cached = cached_calibration()
        if cached is None:
            raise ValueError(
                "hardware='calibrated' reads the figures `trainmesh plan --calibrate` saved for this "
                "machine, torch and thread count; none are saved yet. Received: hardware='calibrated'"
            )
        return cached
    if value in HARDWARE:
        return HARDWARE[value]
    if isinstance(value, str) and value.endswith(".json"):
        try:
            return Hardware.load(value)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"Cannot read hardware figures from {value!r}: {exc}") from exc
    raise ValueError(
        f"hardware is one of {sorted(HARDWARE)}, 'calibrated' or a JSON file written by --calibrate. "
        f"Received: hardware={value!r}"
    )


def link_sharers(hardware: Hardware, stride: int) -> int:
    """How many groups of an axis with rank ``stride`` put a flow through one node's link at once, where a
    node has one link (``inter_link_per_node``): its ``devices_per_node`` consecutive ranks hold members of
    ``min(stride, devices_per_node)`` different groups, and each group's ring enters and leaves the node once."""
    return max(1, min(stride, hardware.devices_per_node)) if hardware.inter_link_per_node else 1


def axis_seconds(
    log: CollectiveLog, hardware: Hardware, strides: dict[str, int], *, all_intra: bool = False
) -> dict[str, float]:
    """Seconds each axis's collectives take on ``hardware`` (``strides``: axis -> rank stride).

    ``all_intra``: every axis priced on the intra-node link, as if its group sat in one node. On a CPU host
    that is what the processes' own cores spend on the traffic; a slower link between nodes adds waiting."""
    out: dict[str, float] = {}
    for row in log.rows():
        axis, size = row["axis"], max(row["group_size"], 1)
        stride = strides.get(axis, hardware.devices_per_node)
        link = hardware.intra if all_intra else hardware.link_for(stride=stride, size=size)
        wire = wire_bytes(row["kind"], row["bytes"], size, hardware.backend)
        if link == hardware.inter:
            wire *= link_sharers(hardware, stride)
        seconds = hardware.collective_seconds(row["kind"], link, row["count"], wire)
        out[axis] = out.get(axis, 0.0) + (seconds if size > 1 else 0.0)
    return out


def _interpolate(curve: tuple, x: float) -> float:
    """``curve`` (ascending ``(x, y)`` points) at ``x``: linear between points, the first point's y below
    them (a message smaller than the smallest measured costs at least its latency), the last segment's
    slope above them."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1 or (x1, y1) == curve[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]
