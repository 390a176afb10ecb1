"""``communication="auto"``: measure the links once at start, then pick how gradients travel.

What is measured (collective, a second or two, once per job; cached in the process and, when
``TRAINMESH_COMM_CACHE`` names a file, on disk, keyed by the host identities and world size):

* latency and bandwidth of the slowest links the reduction uses (across hosts when there are
  several, else between the processes): an all-reduce of 4 bytes and of ``probe_bytes``;
* each candidate reduction run for real on a buffer of the gradients' size (capped at
  ``probe_bytes``): flat fp32 all-reduce, hierarchical fp32 (several hosts), and the two-phase
  int8 exchange (flat or hierarchical).

Choice, and why empirical: the fastest measured candidate wins, but compression (which changes
the numbers) only when it is at least ``COMPRESSION_MARGIN`` faster than the best exact one,
so that on fast links auto stays exact and on slow ones it compresses. A model of the links
would have to know gloo's algorithms and the CPU's quantisation speed; timing the candidates on
the real links knows both. Those timings are of a 2 MB buffer, five repetitions with the
candidates interleaved (each repetition runs every candidate once), on CPUs that may be shared,
so compression must also pass a second test built from the link measurements:
the wire time int8 saves on this process's share of the real gradients at the measured
bandwidth (3/4 of the fp32 bytes) must be at least ``COMPRESSION_MARGIN`` x what quantising and
dequantising that share costs this CPU (timed here, locally). On an unshaped link between
network namespaces one probe timed int8 at 46 ms against fp32's 59 ms on 2 MB while training
steps took 186 ms against 104 ms: the wire saving there is ~2 ms a step, the quantisation ~5 ms.
At 100 Mbit/s it saves hundreds of ms: the two cases are 100x apart on this test, not 1.25x. Bucket size: DDP's buckets are kept unless the latency would cost
more than 5% of a bucket's transfer, then buckets are merged up to ``20 x latency x bandwidth``
(at most the gradients' size and 100 MB). Bandwidth is per process: every process probes its
own inter-host group at once, so it reads the share of the link one process gets in a step.
Rank 0 decides and broadcasts, so every process installs the same plan.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .topology import Topology

CACHE_ENV = "TRAINMESH_COMM_CACHE"
COMPRESSION_MARGIN = 1.25
DDP_BUCKET_BYTES = 25 * 2**20
MAX_BUCKET_BYTES = 100 * 2**20
_CACHE: dict[str, "CommPlan"] = {}


@dataclass(frozen=True)
class CommPlan:
    """What auto chose: ``compression`` (a spec or None), ``hierarchical``, ``bucket_bytes`` (0: DDP's)."""

    compression: str | None
    hierarchical: bool
    bucket_bytes: int
    latency_s: float
    bandwidth_bytes_s: float
    timings_s: dict
    reason: str
    wire_saving_s: float = 0.0  # fp32 wire time int8 would save per step at the measured bandwidth
    quantise_s: float = 0.0  # what quantising and dequantising this process's share costs this CPU

    def describe(self) -> str:
        bucket = f"buckets merged to {self.bucket_bytes / 2**20:.1f}MB" if self.bucket_bytes else "DDP's buckets"
        return (
            f"communication=auto: {'hierarchical' if self.hierarchical else 'flat'} all-reduce, "
            f"compression {self.compression or 'none'}, {bucket}. Why: {self.reason}"
        )


def _time(fn, reps: int, *, barrier: bool = True) -> float:
    """Median seconds of ``fn`` over ``reps`` runs (after one warm-up), the max over ranks;
    ``barrier``: the ranks start each run together (a collective's timing needs it)."""
    return _time_interleaved({"fn": fn}, reps, barrier=barrier)["fn"]


def _time_interleaved(fns: dict, reps: int, *, barrier: bool = True) -> dict:
    """Name -> median seconds of each callable over ``reps`` runs (after one warm-up each), the max
    over ranks; ``barrier``: the ranks start each run together (a collective's timing needs it).

    The runs are interleaved: rep r runs every callable once, in an order rotated by r. Load that
    comes and goes on shared CPUs then lands on every candidate alike; timed one after the other,
    a burst during one candidate's block decided the choice (on an unshaped link int8 timed 23.8 ms
    against fp32's 31.1 ms on 2 MB, while training steps took 86 ms with it against 47 without)."""
    names = list(fns)
    for name in names:
        fns[name]()
    samples: dict = {name: [] for name in names}
    for r in range(reps):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if barrier:
                dist.barrier()
            start = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(samples[name]) for name in names], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(names, medians.tolist()))


def _candidates(numel: int, groups):
    """name -> (compression spec, hierarchical, callable running that reduction once)."""
    from trainmesh.compression import Int8Compressor

    from .hierarchical import hierarchical_all_reduce_
    from .two_phase import hierarchical_compressed_all_reduce, two_phase_all_reduce

    buffer = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    int8 = Int8Compressor()
    out = {"fp32 flat": (None, False, lambda: dist.all_reduce(buffer.clone()))}
    if groups is None:
        out["int8 flat"] = ("int8", False, lambda: two_phase_all_reduce(buffer, None, int8, "probe"))
    else:
        intra, inter = groups
        out["fp32 hierarchical"] = (
            None,
            True,
            lambda: hierarchical_all_reduce_(buffer.clone(), intra_group=intra, inter_group=inter),
        )
        out["int8 hierarchical"] = (
            "int8",
            True,
            lambda: hierarchical_compressed_all_reduce(buffer, intra, inter, int8, "probe"),
        )
    return out


def choose(topology: Topology, groups, gradient_bytes: int, *, probe_bytes: int = 2 * 2**20, reps: int = 5) -> CommPlan:
    """Probe (collective) and choose; the same :class:`CommPlan` on every rank."""
    key = json.dumps([list(topology.host_ids), dist.get_world_size(), int(gradient_bytes), probe_bytes])
    if key in _CACHE:
        return _CACHE[key]
    plan = _load_cached(key)
    if plan is None:
        plan = _measure(topology, groups, gradient_bytes, probe_bytes, reps)
        _store_cached(key, plan)
    _CACHE[key] = plan
    return plan


def _measure(topology: Topology, groups, gradient_bytes: int, probe_bytes: int, reps: int) -> CommPlan:
    slow_group = groups[1] if groups is not None else None
    tiny, big = torch.zeros(1), torch.zeros(max(1, probe_bytes // 4))
    latency = _time(lambda: dist.all_reduce(tiny, group=slow_group), reps)
    big_time = _time(lambda: dist.all_reduce(big, group=slow_group), reps)
    bandwidth = probe_bytes / max(big_time - latency, 1e-9)
    numel = max(1024, min(gradient_bytes, probe_bytes) // 4)
    candidates = _candidates(numel, groups)
    timings = _time_interleaved({name: run for name, (_, _, run) in candidates.items()}, reps)
    specs = {name: (spec, hier) for name, (spec, hier, _) in candidates.items()}
    exact = min((t, n) for n, t in timings.items() if specs[n][0] is None)
    packed = min((t, n) for n, t in timings.items() if specs[n][0] is not None)
    saving, quantise = _wire_saving_s(gradient_bytes, groups, bandwidth), _quantise_s(gradient_bytes, groups)
    if packed[0] * COMPRESSION_MARGIN <= exact[0] and saving < COMPRESSION_MARGIN * quantise:
        best, why = (
            exact[1],
            (
                f"{packed[1]} took {packed[0] * 1e3:.1f}ms vs {exact[1]} {exact[0] * 1e3:.1f}ms on "
                f"a {numel * 4 / 2**20:.1f}MB buffer, but at the measured bandwidth int8 would save "
                f"{saving * 1e3:.1f}ms of wire time a step for {quantise * 1e3:.1f}ms of quantisation, "
                "so gradients stay exact"
            ),
        )
    elif packed[0] * COMPRESSION_MARGIN <= exact[0]:
        best, why = (
            packed[1],
            (
                f"{packed[1]} took {packed[0] * 1e3:.1f}ms vs {exact[1]} {exact[0] * 1e3:.1f}ms on "
                f"a {numel * 4 / 2**20:.1f}MB buffer: the link is slow enough to pay for compression"
            ),
        )
    else:
        best, why = (
            exact[1],
            (
                f"{exact[1]} took {exact[0] * 1e3:.1f}ms; the fastest compressed option "
                f"({packed[1]}, {packed[0] * 1e3:.1f}ms) is not {COMPRESSION_MARGIN}x faster, "
                "so gradients stay exact"
            ),
        )
    # Merging helps only when the gradients span several DDP buckets and a bucket's transfer is
    # short next to the latency; never past the gradients' size (one message at the end of
    # backward would lose all overlap) nor MAX_BUCKET_BYTES.
    bucket = min(int(20 * latency * bandwidth), gradient_bytes, MAX_BUCKET_BYTES)
    bucket_bytes = bucket if gradient_bytes > DDP_BUCKET_BYTES and bucket > DDP_BUCKET_BYTES else 0
    why += (
        f"; {topology.describe()}, slowest link {latency * 1e6:.0f}us latency, "
        f"{bandwidth * 8 / 1e6:.0f} Mbit/s per process"
    )
    decision = [
        CommPlan(specs[best][0], specs[best][1], bucket_bytes, latency, bandwidth, timings, why, saving, quantise)
    ]
    dist.broadcast_object_list(decision, src=0)  # rank 0's reading of the (max-over-ranks) timings wins
    return decision[0]


def _wire_saving_s(gradient_bytes: int, groups, bandwidth: float) -> float:
    """Seconds of the slow link int8 saves per step: 3/4 of this process's fp32 bytes on it.

    Hierarchical: each process sends its 1/L share over the hosts' ring; flat: the whole
    gradients over every process's ring. ``bandwidth`` is per process (every process probed at once).
    """
    from .accounting import ring_wire_bytes

    if groups is not None:
        local, hosts = dist.get_world_size(groups[0]), dist.get_world_size(groups[1])
        fp32 = ring_wire_bytes(-(-gradient_bytes // local), hosts)
    else:
        fp32 = ring_wire_bytes(gradient_bytes, dist.get_world_size())
    return 0.75 * fp32 / max(bandwidth, 1.0)


# Quantisation is timed on at most this many elements and scaled to the share: its cost is linear
# in them, and a large model's whole share (gigabytes of fp32) need not be allocated at start-up.
QUANTISE_PROBE_NUMEL = 2**22


def _quantise_s(gradient_bytes: int, groups) -> float:
    """What quantising this process's share of the gradients (and dequantising it from every
    peer of the exchange) costs this CPU: the max over ranks of a local median (collective)."""
    from trainmesh.compression import Int8Compressor

    peers = dist.get_world_size(groups[1]) if groups is not None else dist.get_world_size()
    share = max(1024, gradient_bytes // 4 // (dist.get_world_size(groups[0]) if groups is not None else 1))
    probed = min(share, QUANTISE_PROBE_NUMEL)
    tensor, int8 = torch.randn(probed, generator=torch.Generator().manual_seed(dist.get_rank())), Int8Compressor()

    def run() -> None:
        payload = int8.compress(tensor)
        for _ in range(peers):
            int8.decompress(payload)

    return _time(run, 3, barrier=False) * share / probed  # local work: each rank's own CPU


def _load_cached(key: str) -> CommPlan | None:
    path = os.environ.get(CACHE_ENV)
    if not path:
        return None
    entry = None
    try:
        with open(path) as fh:
            entry = json.load(fh).get(key)
    except (OSError, ValueError):
        pass
    # Every rank must agree to skip the probe (a rank without the file would otherwise probe alone).
    flag = torch.tensor([0 if entry is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return CommPlan(**entry) if int(flag) == 1 else None


def _store_cached(key: str, plan: CommPlan) -> None:
    path = os.environ.get(CACHE_ENV)
    if not path or dist.get_rank() != 0:
        return
    try:
        table = json.load(open(path)) if os.path.exists(path) else {}
    except (OSError, ValueError):
        table = {}
    table[key] = asdict(plan)
    with open(path + ".tmp", "w") as fh:
        json.dump(table, fh)
    os.replace(path + ".tmp", path)
