"""A job across 2 hosts (network namespaces) vs the same job on 1: parity, a lost host, step time.

    python benchmarks/multihost.py [--rounds R] [--steps S] [--json PATH] [--quick]

Needs root (CAP_NET_ADMIN) for trainmesh.testing.cluster: 2 hosts on a bridge, 198.18.0.0/24,
no default route. Every job is started as on real machines: `trainmesh run --nnodes 2
--nproc-per-node 2 --rdzv-endpoint 198.18.0.1:PORT` in each host (c10d rendezvous), or
`trainmesh run -n 4` in host 0 alone for the one-host side.

* ``dp_2hosts_parity_max_abs_diff``: tests/multihost/dp_job.py (DDP, fp32 Adam, 8 steps) on
  2 hosts x 2 vs 1 host x 4; max |difference| of the final parameters (goal <= 1e-6).
* ``host_kill_resume_identical``, ``host_kill_lost_steps``: tests/multihost/host_ft_job.py,
  sharded async checkpoints every 4 steps; host 1's processes stop after step 6 (2 steps after
  a save), every process of host 1 is SIGKILLed and host 1's launcher started again; the job
  restarts from its last committed checkpoint. Identical: 1 when the final parameters equal an
  uninterrupted run's bit for bit. Lost steps: the kill step minus the step it resumed at
  (goal <= 3: at most one interval is lost, and the save 2 steps back is committed).
* ``dp_2hosts_step_vs_1host``: median DDP step time (a 2.1M-parameter MLP, global batch 64,
  ``tm.Trainer`` defaults on each side: hierarchical all-reduce across hosts, flat on one) of the
  same 4 processes split over 2 hosts with both links shaped to 1 Gbit/s (tbf) vs all on host 0.
  Rounds alternate the side that goes first; the ratio is the median of per-round ratios. Both
  sides must end with the same parameters (within 1e-5), else INVALID. On one shared CPU the
  figure is a ratio for scaling context, not a prediction for real machines.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainmesh.testing.stats import ci95

ROOT = Path(__file__).resolve().parent.parent
DP_JOB = ROOT / "tests" / "multihost" / "dp_job.py"
FT_JOB = ROOT / "tests" / "multihost" / "host_ft_job.py"
ENV = {"OMP_NUM_THREADS": "1", "TRAINMESH_TIMEOUT_S": "60"}
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3"
SAVE_EVERY, KILL_AT = 4, 6
WIDTH, GLOBAL_BATCH = 1024, 64


# --- the step-time job: this file run as a worker under `trainmesh run` -----------------------
def worker(steps: int, out: str) -> None:
    import trainmesh as tm

    tm.initialize()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, 256),
    )
    g = torch.Generator().manual_seed(1)
    n = steps * GLOBAL_BATCH
    data = (torch.randn(n, 256, generator=g), torch.randn(n, 256, generator=g))
    stamps: list[float] = []

    class Clock(tm.Callback):
        def on_train_batch_end(self, step, logs=None):
            stamps.append(time.perf_counter())

    trainer = tm.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.nn.MSELoss(), callbacks=[Clock()], progress=False
    )
    trainer.fit(data, epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
    final = trainer.state_dict()["model"]
    if tm.is_main_process():
        times = [b - a for a, b in zip(stamps[2:], stamps[3:])]  # after 2 warm-up steps
        torch.save(final, os.path.join(out, "final.pt"))
        with open(os.path.join(out, "times.json"), "w") as fh:
            json.dump({"step_s": times, "world_size": tm.world_size()}, fh)
    tm.shutdown()


# --- launching -----------------------------------------------------------------------------------
def _run(host, script_args: list[str], *run_args: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainmesh", "run", *run_args, *script_args]
    return host.popen(cmd, env=ENV, stdout=open(log, "a"), stderr=subprocess.STDOUT)


def _multi(host, port: int, *extra: str) -> list[str]:
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--node-rank",
        str(host.index),
        "--rdzv-endpoint",
        f"{host.cluster.hosts[0].address}:{port}",
        "--rdzv-id",
        f"bench{port}",
        "--rdzv-conf",
        RDZV_CONF,
        *extra,
    ]


def _wait(procs, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"a launcher failed ({[p.returncode for p in procs]}); its log ends:\n{_tail(log)}")


def _tail(log: Path) -> str:
    lines = [
        line
        for line in log.read_text().splitlines()
        if "Warning" not in line and "return func" not in line and not line.startswith("frame #")
    ]
    return "\n".join(lines[-40:])


class Ports:
    next = 29500

    @classmethod
    def take(cls) -> int:
        cls.next += 1
        return cls.next


def _max_abs_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def parity(cluster, work: Path) -> float:
    one, two = work / "parity1", work / "parity2"
    one.mkdir()
    two.mkdir()
    log = work / "parity.log"
    _wait([_run(cluster.hosts[0], [str(DP_JOB), "--out", str(one), "--runs", "dp"], "-n", "4", log=log)], log)
    port = Ports.take()
    _wait(
        [_run(h, [str(DP_JOB), "--out", str(two), "--runs", "dp"], *_multi(h, port), log=log) for h in cluster.hosts],
        log,
    )
    return _max_abs_diff(torch.load(one / "final_dp.pt"), torch.load(two / "final_dp.pt"))


def _ft_args(out: Path, *extra: str) -> list[str]:
    return [str(FT_JOB), "--out", str(out), "--every", str(SAVE_EVERY), "--step-sleep", "0.2", *extra]


def host_kill(cluster, work: Path) -> tuple[int, int, float]:
    """(identical, lost steps, max |diff|) of a run that loses host 1 at KILL_AT vs an uninterrupted one."""
    ref, hit = work / "ft_ref", work / "ft_kill"
    ref.mkdir()
    hit.mkdir()
    log = work / "host_kill.log"
    port = Ports.take()
    _wait([_run(h, _ft_args(ref), *_multi(h, port, "--max-restarts", "2"), log=log) for h in cluster.hosts], log)
    port = Ports.take()
    host0, host1 = cluster.hosts
    survivor = _run(host0, _ft_args(hit), *_multi(host0, port, "--max-restarts", "2"), log=log)
    _run(host1, _ft_args(hit, "--stall-at", str(KILL_AT)), *_multi(host1, port, "--max-restarts", "2"), log=log)
    deadline = time.monotonic() + 300
    while len(glob.glob(str(hit / "stalled.rank*"))) < 2:
        if time.monotonic() > deadline or survivor.poll() is not None:
            raise RuntimeError(f"host 1 never reached step {KILL_AT}; its log ends:\n{_tail(log)}")
        time.sleep(0.2)
    time.sleep(0.5)
    host1.kill()
    back = _run(host1, _ft_args(hit, "--tag", "back"), *_multi(host1, port, "--max-restarts", "2"), log=log)
    _wait([survivor, back], log)
    resumed = [
        int(line.split()[2])
        for name in glob.glob(str(hit / "samples.rank*.log"))
        for line in Path(name).read_text().splitlines()
        if line.startswith("RESUME run-1 ")
    ]
    if not resumed:
        raise RuntimeError(f"no restart was logged; the log ends:\n{_tail(log)}")
    a, b = torch.load(ref / "final.pt"), torch.load(hit / "final.pt")
    identical = int(all(torch.equal(a[k], b[k]) for k in a))
    return identical, KILL_AT - min(resumed), _max_abs_diff(a, b)


def step_time(cluster, work: Path, side: str, steps: int, index: int) -> tuple[float, dict]:
    out = work / f"step_{side.replace(' ', '_')}_{index}"
    out.mkdir()
    log = work / "step.log"
    script = [str(Path(__file__).resolve()), "--worker", "--steps", str(steps), "--out", str(out)]
    if side == "1 host":
        _wait([_run(cluster.hosts[0], script, "-n", "4", log=log)], log)
    else:
        port = Ports.take()
        _wait([_run(h, script, *_multi(h, port), log=log) for h in cluster.hosts], log)
    result = json.loads((out / "times.json").read_text())
    assert result["world_size"] == 4, result
    return statistics.median(result["step_s"]), torch.load(out / "final.pt")


def _load() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return fh.read().split()[0]
    except OSError:
        return "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="step-time launches per side")
    parser.add_argument("--steps", type=int, default=20, help="steps per step-time launch")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="1 round of 8 steps per side")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.out)
        return 0
    if args.quick:
        args.rounds, args.steps = 1, 8
    from trainmesh.testing.cluster import Cluster, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"SKIPPED: no network-namespace cluster here: {reason}")
        return 2
    with Cluster(2) as cluster, tempfile.TemporaryDirectory(prefix="multihost-bench-") as tmp:
        cluster.wait_reachable()
        work = Path(tmp)
        parity_diff = parity(cluster, work)
        identical, lost_steps, kill_diff = host_kill(cluster, work)
        for host in cluster.hosts:
            host.shape(rate="1gbit")
        times: dict[str, list[float]] = {"1 host": [], "2 hosts 1Gbit": []}
        finals: list[dict] = []
        for index in range(args.rounds):
            order = ["1 host", "2 hosts 1Gbit"] if index % 2 == 0 else ["2 hosts 1Gbit", "1 host"]
            for side in order:
                seconds, final = step_time(cluster, work, side, args.steps, index)
                times[side].append(seconds)
                finals.append(final)
        same_work = max(_max_abs_diff(finals[0], f) for f in finals[1:])
    ratios = [b / a for a, b in zip(times["1 host"], times["2 hosts 1Gbit"])]
    ratio = statistics.median(ratios)
    low, high = ci95(ratios)
    print(
        f"2 network-namespace hosts x 2 processes vs 1 host x 4 (gloo, CPU, 1 thread each), "
        f"torch {torch.__version__}, {platform.machine()}, load {_load()}"
    )
    print(f"{'side':<16}{'median s/step':>15}{'95% of launches':>24}")
    for side, values in times.items():
        lo, hi = ci95(values)
        print(f"{side:<16}{statistics.median(values):>15.4f}{f'[{lo:.4f}, {hi:.4f}]':>24}")
    print(
        f"dp_2hosts_step_vs_1host        {ratio:.3f}  (95% of rounds in [{low:.3f}, {high:.3f}]; "
        f"{len(ratios)} rounds, MLP {WIDTH} wide, global batch {GLOBAL_BATCH})"
    )
    print(f"dp_2hosts_parity_max_abs_diff  {parity_diff:.3g}  (goal <= 1e-6)")
    print(f"host_kill_resume_identical     {identical}  (max |diff| {kill_diff:.3g})")
    print(
        f"host_kill_lost_steps           {lost_steps}  (saves every {SAVE_EVERY}, host killed at step {KILL_AT}; goal <= 3)"
    )
    figures = {
        "dp_2hosts_parity_max_abs_diff": parity_diff,
        "host_kill_resume_identical": identical,
        "host_kill_lost_steps": lost_steps,
        "dp_2hosts_step_vs_1host": ratio,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "figures": figures,
                    "detail": {"step_s": times, "ratios": ratios, "step_sides_max_abs_diff": same_work},
                },
                fh,
                indent=2,
            )
    if same_work > 1e-5:
        print(f"INVALID: the step-time launches ended with different parameters (max |diff| {same_work:.3g})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
