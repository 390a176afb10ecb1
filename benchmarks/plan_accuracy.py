"""How true is ``trainmesh plan``? Plan a run, then run it for real on 2 and 4 (8 in the full run) gloo processes.

Cases: DP, ZeRO-3, TP, a pipeline (pipe=2) at 2 processes; ZeRO-3 + checkpointing, TP x ZeRO-3 and
pipe x ZeRO-3 at 4; the full run adds pipe x data x model and TP x ZeRO-3 at 8. The model is a Llama
from transformers built from a config (no download). All on loopback; then on shaped links
(``testing.host_jobs``; skipped with the reason where this is not root, or with ``--no-shaped``):
two network-namespace hosts, both links shaped to 1 Gbit/s, the 2-process cases with a process on
each host and (full run) TP x ZeRO-3 and pipe x ZeRO-3 at 4 with 2 per host, planned with the link
between two such hosts measured first (``trainmesh.planner.calibrate_hosts``, what ``trainmesh plan
--calibrate --host-link 1gbit`` measures) as the inter-node link.

* planned, before anything runs: this machine is calibrated (``trainmesh.planner.calibrate``: matmul
  and memory-bandwidth curves, per-op and per-DTensor-op overheads of a tiny model's step, loopback
  alpha/beta, cores); every rank is dry-run on torch's fake process group
  (``planner.dry_run.run_rank``) and the step is priced with those figures
  (``planner.parallel.estimate_step``: every op of the dry run, collectives per axis, overlap,
  processes sharing the cores, the pipeline bubble);
* measured on real processes, same model, batch and settings, independently of the plan:
  - step time: wall clock of real training steps (forward, backward, optimizer step; a pipeline runs
    torch's schedule through trainmesh's runner), the slowest rank per step; the cases of one world
    size are set up together and their steps interleaved, round after round. Each round, rank 0
    measures the per-op figures and the core-sharing probe alone, and all processes run the probe
    at once right before and right after each step (``planner.calibrate_cores``): the plan of that
    round prices its step with them;
  - communication: the bytes each process wrote to its sockets during a step (``wchar`` of
    ``/proc/self/io``: gloo's TCP pairs write with ``write``/``writev``; the process prints nothing
    while timed), against the plan's bytes on the wire (``collectives.wire_bytes`` with gloo's
    algorithms); on Linux only;
  - memory: the peak of live CPU tensor bytes over two training steps
    (``trainmesh.testing.memory.LiveTensorBytes``, the tracker the planner tests and zero_memory use),
    against the plan's peak (params + optimizer + buffers + max(grads, activations)).

Checks that both sides did the same work (INVALID otherwise): the FLOPs of a real step (counted on it)
equal the plan's (within 2% for a pipeline, whose loss is computed a little differently).

Figures (``--json``): ``plan_step_time_vs_measured_worst`` (per case, the median over rounds of the
round's planned step, priced with the figures measured in that round, over the round's measured step;
the median plan over the median step and the plan priced before the run are printed beside it),
``plan_comm_bytes_vs_counted_worst`` (planned wire bytes / socket bytes), ``plan_memory_vs_measured_worst``:
each the ratio farthest from 1 over cases (and ranks).

    python benchmarks/plan_accuracy.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from trainmesh.testing.memory import LiveTensorBytes
from trainmesh.testing.stats import ci95

MODEL = dict(
    model_type="llama",
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=4096,
    max_position_embeddings=256,
)
MICRO_BATCH, SEQ = 4, 128
MICROBATCHES = 4  # a pipeline step: 4 microbatches of MICRO_BATCH // 4 rows, the same tokens as the others
CASES = [  # (processes, mesh, zero stage, checkpointing, label)
    (2, "data=2", 0, None, "DP"),
    (2, "data=2", 3, None, "ZeRO-3"),
    (2, "data=1,model=2", 0, None, "TP"),
    (2, "pipe=2,data=1", 0, None, "PP"),
    (4, "data=4", 3, "full", "ZeRO-3+AC"),
    (4, "data=2,model=2", 3, None, "TPxZeRO-3"),
    (4, "pipe=2,data=2", 3, None, "PPxZeRO-3"),
    (8, "pipe=2,data=2,model=2", 3, None, "3-D"),
    (8, "data=4,model=2", 3, None, "TPxZeRO-3"),
]
QUICK = ("DP", "ZeRO-3", "TP", "PP")  # 2 processes: every kind of axis, one launch
# --smoke (the test suite's): the quick cases on a tiny model, one round, a short calibration. The spawned
# processes read the size from the environment (they import this module anew).
SMOKE_ENV = "TRAINMESH_PLAN_ACCURACY_SMOKE"
if os.environ.get(SMOKE_ENV):
    MODEL = dict(
        MODEL,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=32,
    )
    SEQ = 32


def build_model():
    from trainmesh.planner.models import _from_config

    return _from_config(MODEL)


def _is_pipe(mesh: str) -> bool:
    return mesh.startswith("pipe=")


def _rows(mesh: str) -> int:
    return MICRO_BATCH // MICROBATCHES if _is_pipe(mesh) else MICRO_BATCH


def _socket_bytes() -> int:
    """Bytes this process has written with write-family calls (gloo's sockets; nothing else writes while timed)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split(":")[1]) for line in f if line.startswith("wchar"))
    except (OSError, StopIteration):
        return -1


def _raise_priority(enabled: bool) -> str:
    """A plan is for a machine the job has to itself; this one is shared. The measured processes (and the
    probes that price them) run at a raised priority where the OS allows it, so other users' load
    moves them less; where it does not (not root), they run as they are and the output says so."""
    if not enabled:
        return "priority not raised (--no-priority)"
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "measured at raised priority (nice -10)"
    except (OSError, AttributeError) as exc:
        return f"priority not raised ({type(exc).__name__}): other load on this machine is in the timings"


def _setup(case):
    """Parallelize one case as training does; returns a function that runs one training step."""
    import trainmesh as tm
    from trainmesh._torch.parallelize import parallelize
    from trainmesh.planner.mesh_spec import MeshSpec
    from trainmesh.planner.model_states import resolve_optimizer
    from trainmesh.trainer.loss_tracking import LossAccumulator
    from trainmesh.trainer.precision import build_precision

    _, mesh, zero, checkpointing, _ = case
    spec = MeshSpec.parse(mesh, tm.world_size())
    torch.manual_seed(0)
    model = build_model()
    distribution = spec.distribution(model, zero_stage=zero, microbatches=MICROBATCHES)
    model = parallelize(model, distribution, zero_stage=zero, activation_checkpointing=checkpointing)
    model.train()
    opt = distribution.prepare_optimizer(resolve_optimizer("adam")([p for p in model.parameters()]), model)
    ids = torch.randint(0, MODEL["vocab_size"], (_rows(mesh) * (MICROBATCHES if _is_pipe(mesh) else 1), SEQ))
    runner = getattr(model, "_trainmesh_pipeline", None)
    precision, losses = build_precision("fp32"), LossAccumulator()

    def lm_loss(output, target):  # the loss the planner's dry run computes on a last stage
        logits = output.logits  # the model's own output type, with or without a pipe axis (one loss contract)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def step():
        if runner is None:
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            runner.forward_backward([(ids, ids)], lm_loss, precision, losses)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _worker(cases, rounds: int, hardware, priority: bool) -> dict:
    import trainmesh as tm

    _raise_priority(priority)
    from trainmesh.planner.calibrate_ops import measure_compute
    from trainmesh.planner.flops import LocalFlops
    from trainmesh.planner.op_costs import OpProfile

    from trainmesh.planner.calibrate_cores import probe_work, run_window

    steps, peaks, flops, ops = [], [], [], []
    for case in cases:
        with LiveTensorBytes("cpu") as tracker:
            step = _setup(case)
            # A pipeline builds the whole model on every process before it keeps its stage: that is
            # construction, not a step; the plan is the peak of a training step.
            tracker.reset_peak()
            step()  # the first step creates the optimizer state; the second runs with it
            with LocalFlops() as counter, OpProfile() as profile:
                step()
        steps.append(step)
        peaks.append(tracker.peak)
        flops.append(counter.total)
        ops.append(profile.ops())
    times = [[] for _ in cases]
    cpu = [[] for _ in cases]  # CPU seconds the process spent in the step (a diagnostic: wall minus this is waiting)
    wire = [[] for _ in cases]
    probes, shares = [], []
    work = probe_work()
    n = tm.world_size()
    window = 0.2
    for r in range(rounds):
        # The machine is shared and its load moves by the second: the per-op figures are measured again
        # every round by one process alone (the others wait in a barrier), and so is the rate of the
        # core-sharing probe (calibrate_cores) alone and with 2 processes at once; right before each
        # case's step, all n processes run the probe at once. Each step is priced with its own round's
        # figures (how much slower a process runs among n than alone, beside the step it prices).
        rates: dict = {"cases": {}}
        if tm.rank() == 0:
            probes.append(measure_compute(hardware, repeats=3).to_dict())
            units, wall, _ = run_window(work, window)
            rates[1] = units / wall
        for p in [2] if n > 2 else []:
            tm.barrier()
            if tm.rank() < p:
                units, wall, _ = run_window(work, window)
                rates[p] = units / wall
        for i in [(r + k) % len(cases) for k in range(len(cases))]:  # interleaved, in a rotating order
            tm.barrier()
            units, wall, _ = run_window(work, window)
            before = wall / units
            tm.barrier()
            written = _socket_bytes()
            start, used = time.perf_counter(), time.process_time()
            steps[i]()
            times[i].append(time.perf_counter() - start)
            cpu[i].append(time.process_time() - used)
            wire[i].append(_socket_bytes() - written)
            units, wall, _ = run_window(work, window)  # and right after it: the load during the step is between
            rates["cases"][i] = 2 / (before + wall / units)
        shares.append(rates)
    return {
        "times": times,
        "cpu": cpu,
        "wire": wire,
        "peaks": peaks,
        "flops": flops,
        "ops": ops,
        "probes": probes,
        "shares": shares,
    }


def _round_hardware(hardware, measured: list[dict], k: int, index: int):
    """Round ``k``'s figures for case ``index``: rank 0's per-op probe, and the core-sharing curve
    ((1, 1), (2, alone / rate of 2 at once), (n, alone / rate of n at once around the step)), each
    rate of several processes the slowest one's (``calibrate_cores.pace_of``), as in the plan's own
    calibration: the step waits for its slowest process."""
    from dataclasses import replace

    from trainmesh.planner.calibrate_cores import pace_of
    from trainmesh.planner.hardware import Hardware

    n = len(measured)
    alone = measured[0]["shares"][k][1]
    curve = [(1, 1.0)]
    if n > 2:
        curve.append((2, alone / pace_of([measured[r]["shares"][k][2] for r in range(2)])))
    curve.append((n, alone / pace_of([measured[r]["shares"][k]["cases"][index] for r in range(n)])))
    probe = Hardware.from_dict(measured[0]["probes"][k])
    return replace(
        hardware,
        flops=probe.flops,
        flops_curve=probe.flops_curve,
        bandwidth_curve=probe.bandwidth_curve,
        memory_bandwidth=probe.memory_bandwidth,
        op_overhead=probe.op_overhead,
        op_kind_curves=probe.op_kind_curves,
        external_load=probe.external_load,
        contention_curve=tuple(curve),
    )


def _median_hardware(hardware, probes: list[dict]):
    """``hardware`` with each per-op figure the median of the rounds' probes (curves point by point)."""
    from dataclasses import replace

    from trainmesh.planner.hardware import Hardware

    probes = [Hardware.from_dict(p) for p in probes]

    def curve(name):
        return tuple(
            (size, statistics.median(getattr(p, name)[i][1] for p in probes))  # noqa: E731
            for i, (size, _) in enumerate(getattr(probes[0], name))
        )

    flops_curve, bandwidth_curve = curve("flops_curve"), curve("bandwidth_curve")
    kinds = tuple(
        (
            kind,
            tuple(
                (size, statistics.median(dict(p.op_kind_curves)[kind][i][1] for p in probes))
                for i, (size, _) in enumerate(points)
            ),
        )
        for kind, points in probes[0].op_kind_curves
    )
    return replace(
        hardware,
        flops=max(r for _, r in flops_curve),
        flops_curve=flops_curve,
        bandwidth_curve=bandwidth_curve,
        memory_bandwidth=bandwidth_curve[-1][1],
        op_kind_curves=kinds,
        op_overhead=statistics.median(p.op_overhead for p in probes),
        external_load=statistics.median(p.external_load for p in probes),
    )


def _dry_run(case) -> list:
    """Every rank of ``case`` dry-run on the fake process group (trainmesh's parallelize, fake tensors)."""
    from trainmesh.planner.dry_run import run_rank
    from trainmesh.planner.mesh_spec import MeshSpec
    from trainmesh.planner.meta_model import build_meta_model

    n, mesh, zero, checkpointing, _ = case
    spec = MeshSpec.parse(mesh, n)
    meta = build_meta_model(build_model)
    results, boundary = [], None
    for rank in range(n):  # rank order is pipe order: the first stage tells the others what they receive
        result = run_rank(
            meta,
            spec,
            rank,
            zero_stage=zero,
            activation_checkpointing=checkpointing,
            precision="fp32",
            micro_batch=_rows(mesh),
            seq_len=SEQ,
            microbatches=MICROBATCHES,
            boundary=boundary,
        )
        boundary = boundary or result.boundary
        results.append(result)
    return results


def _price(case, results: list, hardware) -> dict:
    from trainmesh.planner.collectives import wire_bytes
    from trainmesh.planner.mesh_spec import MeshSpec
    from trainmesh.planner.parallel import ParallelPlan, estimate_step

    n, mesh, zero, checkpointing, _ = case
    spec = MeshSpec.parse(mesh, n)
    step = estimate_step(results, spec, hardware, tokens_per_rank=None, shape={})
    plan = ParallelPlan(
        model="bench",
        mesh=spec,
        zero_stage=zero,
        activation_checkpointing=checkpointing,
        precision="fp32",
        micro_batch=_rows(mesh),
        seq_len=SEQ,
        num_parameters=0,
        ranks=results,
        step=step,
        hardware=hardware,
        device_memory=None,
    )
    wire = [
        sum(wire_bytes(row["kind"], row["bytes"], row["group_size"], hardware.backend) for row in r.collectives.rows())
        for r in results
    ]
    return {
        "peaks": [plan.peak(r) for r in results],
        "step": step,
        "wire": wire,
        "flops": [r.flops for r in results],
        "ops": [r.ops.ops() for r in results],
    }


def _compare(
    group: list,
    dry: list,
    measured: list[dict],
    hardware,
    rounds: int,
    link: str,
    rows: list,
    worst: dict,
    invalid: list,
) -> None:
    """Price each case of ``group`` (one world size, measured on ``link``) with ``hardware`` and the figures measured
    during its rounds, against what its processes measured; rows, worst ratios and INVALID lines are appended."""
    n = group[0][0]
    during = _median_hardware(hardware, measured[0]["probes"])
    print(
        f"\n{n} processes, {link}; per-op figures measured during the rounds (median of {rounds}):\n"
        + "\n".join(during.describe().splitlines()[1:4])
        + f"\n  external load {during.external_load:.1f} runnable"
    )
    for index, (case, results) in enumerate(zip(group, dry)):
        plan = _price(case, results, during)
        before = _price(case, results, hardware).get("step").seconds
        round_hw = [_round_hardware(hardware, measured, k, index) for k in range(rounds)]
        planned = [_price(case, results, hw)["step"] for hw in round_hw]
        plan["step"] = sorted(planned, key=lambda e: e.seconds)[len(planned) // 2]  # the median round's plan
        slowdowns = [hw.contention(n) for hw in round_hw]
        per_round = [max(measured[r]["times"][index][k] for r in range(n)) for k in range(rounds)]
        median, (low, high) = statistics.median(per_round), ci95(per_round)
        cpu_used = statistics.median(statistics.median(measured[r]["cpu"][index]) for r in range(n))
        # Each round's step against the plan priced with that round's figures (measured beside it):
        # the load moves both together, so the per-round ratio is the plan's error, not the load's.
        paired = [e.seconds / t for e, t in zip(planned, per_round)]
        step_ratio = statistics.median(paired)
        unpaired = plan["step"].seconds / median
        print(
            f"  {case[4]:<10} each of {n} processes {statistics.median(slowdowns):.2f}x slower than one alone "
            f"(rounds {min(slowdowns):.2f}-{max(slowdowns):.2f}); plan/step per round {step_ratio:.2f} "
            f"(95% {ci95(paired)[0]:.2f}-{ci95(paired)[1]:.2f}); median plan / median step {unpaired:.2f}"
        )
        worst["step"].append(step_ratio)
        for rank in range(n):
            real = measured[rank]
            tolerance = 0.02 if _is_pipe(case[1]) else 0.0
            if abs(plan["flops"][rank] - real["flops"][index]) > tolerance * real["flops"][index]:
                invalid.append(
                    f"{case[4]} n={n} ({link}) rank {rank}: planned {plan['flops'][rank]} and run "
                    f"{real['flops'][index]} FLOPs differ (not the same work)"
                )
            socket = statistics.median(real["wire"][index])
            comm = plan["wire"][rank] / socket if socket > 0 else (1.0 if plan["wire"][rank] == 0 else float("nan"))
            memory = plan["peaks"][rank] / real["peaks"][index]
            worst["memory"].append(memory)
            worst["comm"].append(comm)
            rows.append(
                {
                    "case": case[4],
                    "n": n,
                    "mesh": case[1],
                    "link": link,
                    "rank": rank,
                    "plan_peak": plan["peaks"][rank],
                    "peak": real["peaks"][index],
                    "memory_ratio": memory,
                    "plan_wire": plan["wire"][rank],
                    "socket_bytes": socket,
                    "comm_ratio": comm,
                    "plan_ops": plan["ops"][rank],
                    "ops": real["ops"][index],
                    "plan_step": plan["step"].seconds,
                    "step": median,
                    "step_ci95": [low, high],
                    "step_cpu": cpu_used,
                    "step_ratio": step_ratio,
                    "step_ratio_unpaired": unpaired,
                    "step_ratio_rounds": paired,
                    "step_slowdown_rounds": slowdowns,
                    "plan_step_before": before,
                    "step_ratio_before": before / median,
                    "step_ratio_ci95": list(ci95(paired)),
                    "plan_parts": {
                        **{k: v for k, v in plan["step"].phases.items()},
                        **{f"{a} exposed": v for a, v in plan["step"].exposed.items()},
                    },
                }
            )


# Across hosts: the 2-process cases (a process per host), and at 4 processes (2 hosts x 2) and 8 (2 hosts x 4),
# full run only, the layouts whose axes split between the link inside a host and the link between hosts.
ACROSS_HOSTS = {4: ("TPxZeRO-3", "PPxZeRO-3"), 8: ("3-D", "TPxZeRO-3")}
RATE = "1gbit"  # the rate benchmarks/multihost.py shapes its hosts to


def _shaped_group(cases: list, rounds: int, hardware, args, rows: list, worst: dict, invalid: list) -> str:
    """The cases again on two namespace hosts whose links are shaped (``testing.host_jobs.run_on_hosts``: this
    file's ``_worker`` on each rank), planned with the link measured between two such hosts as the inter-node
    link and hosts of n / 2 processes."""
    from trainmesh.planner.calibrate_hosts import measure_host_link, with_host_link
    from trainmesh.testing.cluster import ClusterUnavailable
    from trainmesh.testing.host_jobs import run_on_hosts

    groups = [[c for c in cases if c[0] == 2]] + [
        [c for c in cases if c[0] == n and c[4] in labels] for n, labels in ACROSS_HOSTS.items()
    ]
    try:
        link = measure_host_link(RATE)
    except ClusterUnavailable as exc:
        return f"shaped (netns) links not used: {exc}"
    for group in [g for g in groups if g]:
        per_host = group[0][0] // 2
        host_hardware = with_host_link(hardware, *link, processes_per_host=per_host)
        if per_host == 1:
            print("\n" + "\n".join(host_hardware.describe().splitlines()[-5:]))
        dry = [_dry_run(case) for case in group]
        measured = run_on_hosts(
            "plan_accuracy:_worker",
            (group, rounds, host_hardware, args.priority),
            group[0][0],
            processes_per_host=per_host,
            rate=RATE,
            path=[os.path.dirname(os.path.abspath(__file__))],
            env={"TRAINMESH_TIMEOUT_S": "900"},
        )
        _compare(group, dry, measured, host_hardware, rounds, f"2 hosts at {RATE}", rows, worst, invalid)
    beyond_two = "; ".join(f"{', '.join(labels)} at {n} ({n // 2} per host)" for n, labels in ACROSS_HOSTS.items())
    return (
        f"shaped links: the two-process cases (a process per host) and, in the full run, {beyond_two} "
        f"also ran on two network-namespace hosts, links shaped to {RATE} (tbf), planned with the link measured "
        f"between two such hosts"
    )


def _farthest(values):
    return max(values, key=lambda v: abs(v - 1) if v == v else float("inf"), default=1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)} only, fewer rounds")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"the code path only (the test suite's): {', '.join(QUICK)} "
        "on a tiny model, 1 round, no link or core-sharing calibration, no shaped links",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed steps per case (default 8 quick, 10 full; the step figure is a median over them)",
    )
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument(
        "--cases",
        default=None,
        metavar="LABEL,...",
        help="run only the cases with these labels (e.g. 3-D,DP), at every size that has them",
    )
    parser.add_argument(
        "--no-shaped",
        dest="shaped",
        action="store_false",
        help="skip the shaped-link group (two-process cases across two network-namespace hosts)",
    )
    parser.add_argument(
        "--no-priority",
        dest="priority",
        action="store_false",
        help="do not raise the measured processes' priority (they then share the CPU with all load)",
    )
    args = parser.parse_args()
    if args.smoke and not os.environ.get(SMOKE_ENV):  # this module's sizes are read at import: start again
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, **{SMOKE_ENV: "1"}))
    args.quick = args.quick or args.smoke
    args.shaped = args.shaped and not args.smoke
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from trainmesh.planner.calibrate import calibrate
    from trainmesh.testing import run_distributed

    cases = [c for c in CASES if not args.quick or (c[4] in QUICK and c[0] == 2)]
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {c[4] for c in CASES}
        if unknown:
            parser.error(
                f"--cases: no case labelled {', '.join(sorted(unknown))}; "
                f"the labels are {', '.join(dict.fromkeys(c[4] for c in CASES))}"
            )
        cases = [c for c in cases if c[4] in wanted]
    rounds = args.rounds or (1 if args.smoke else 8 if args.quick else 10)
    priority_note = _raise_priority(args.priority)
    print(priority_note)
    # this machine now, under its current load; one thread per process
    hardware = calibrate(save=False, link=not args.smoke, contention=not args.smoke)
    print(hardware.describe())
    rows, invalid = [], []
    worst = {"memory": [], "comm": [], "step": []}
    for n in sorted({c[0] for c in cases}):
        group = [c for c in cases if c[0] == n]
        dry = [_dry_run(case) for case in group]  # planned before anything runs
        measured = run_distributed(_worker, world_size=n, args=(group, rounds, hardware, args.priority), timeout=1200)
        _compare(group, dry, measured, hardware, rounds, "loopback", rows, worst, invalid)
    shaped_note = (
        _shaped_group(cases, rounds, hardware, args, rows, worst, invalid)
        if args.shaped
        else "shaped (netns) links not used (--no-shaped)"
    )
    print(
        f"\n{'case':<10}{'n':>2} {'mesh':<22}{'link':<16}{'rank':>4} {'plan MiB':>9} {'meas MiB':>9} {'ratio':>6}  "
        f"{'plan MB':>8} {'sock MB':>8} {'ratio':>6}  {'plan ops':>8} {'ops':>6}"
    )
    for r in rows:
        print(
            f"{r['case']:<10}{r['n']:>2} {r['mesh']:<22}{r['link']:<16}{r['rank']:>4} {r['plan_peak'] / 2**20:>9.1f} "
            f"{r['peak'] / 2**20:>9.1f} {r['memory_ratio']:>6.3f}  {r['plan_wire'] / 1e6:>8.2f} "
            f"{r['socket_bytes'] / 1e6:>8.2f} {r['comm_ratio']:>6.3f}  {r['plan_ops']:>8} {r['ops']:>6}"
        )
    print(
        f"\nstep time ({rounds} interleaved rounds; measured = slowest rank per step, median and 95% interval; "
        "ratio = median over rounds of the round's plan / the round's step; unpair = median plan / median step; "
        "before = the plan on the figures calibrated before the run / median step)"
    )
    print(
        f"{'case':<10}{'n':>2} {'mesh':<22}{'link':<16}{'plan ms':>8} {'meas ms':>8} {'95% interval':>16} {'ratio':>6} "
        f"{'ratio 95%':>12} {'unpair':>7} {'before':>7} {'cpu ms':>7}  planned parts (ms)"
    )
    for r in rows:
        if r["rank"]:
            continue
        parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r["plan_parts"].items() if v > 5e-4)
        print(
            f"{r['case']:<10}{r['n']:>2} {r['mesh']:<22}{r['link']:<16}{r['plan_step'] * 1e3:>8.1f} {r['step'] * 1e3:>8.1f} "
            f"{r['step_ci95'][0] * 1e3:>7.1f}-{r['step_ci95'][1] * 1e3:<8.1f} {r['step_ratio']:>6.2f} "
            f"{r['step_ratio_ci95'][0]:>5.2f}-{r['step_ratio_ci95'][1]:<6.2f} {r['step_ratio_unpaired']:>7.2f} {r['step_ratio_before']:>7.2f} {r['step_cpu'] * 1e3:>7.0f}  {parts}"
        )
    figures = {
        "plan_memory_vs_measured_worst": round(_farthest(worst["memory"]), 4),
        "plan_comm_bytes_vs_counted_worst": round(_farthest(worst["comm"]), 4),
        "plan_step_time_vs_measured_worst": round(_farthest(worst["step"]), 4),
    }
    print(json.dumps(figures))
    print(priority_note)
    print("comm bytes are counted at the sockets (independent of the planner's dispatcher counter)")
    print(shaped_note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "figures": figures,
                    "rows": rows,
                    "hardware": hardware.to_dict(),
                    "invalid": invalid,
                    "rounds": rounds,
                    "priority": priority_note,
                    "shaped_links": shaped_note,
                },
                f,
                indent=2,
            )
    if invalid:
        print("INVALID: " + "; ".join(invalid))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
