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
import sys

import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the parts beside it, when loaded by path
from plan_accuracy_compare import _compare  # noqa: E402
from plan_accuracy_measure import _raise_priority, _worker  # noqa: E402  (run_on_hosts names plan_accuracy:_worker)
from plan_accuracy_plan import _dry_run  # noqa: E402
from plan_accuracy_setup import CASES, QUICK, SMOKE_ENV  # noqa: E402

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
