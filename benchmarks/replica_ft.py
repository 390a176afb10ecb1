"""Fault-tolerant replica groups (torchft under the Trainer) against a restart from checkpoint.

    python benchmarks/replica_ft.py [--faults N] [--seed S] [--quick] [--json PATH]

The job: an MLP (``--hidden``) on a seeded regression set, global batch 32, AdamW, a
``ShardedCheckpoint`` every ``INTERVAL`` steps (synchronous) on both sides. Four processes either way
(``--group-size 1``: two), ZeRO-2 over the processes of a job or of a group:

* ``ft``: two replica groups of ``--group-size`` processes each (default 2, ZeRO-2 inside a group),
  each its own ``trainmesh run -n 2 --replica-group g``, under a torchft Lighthouse
  (``Trainer(fault_tolerance=ReplicaGroups())``). A fault SIGKILLs the last rank of a seeded group in the
  middle of a backward (the other groups are then in the step's all-reduce; torchrun ends the group's
  other rank); the driver starts the group again, it heals from the survivors. While it starts, the survivor waits (*after* its step's record, so no measured time
  includes the wait) until the restarted process is about to join, so that 20 faults fit in a short job.
* ``restart``: ``trainmesh run -n 4 --max-restarts N`` (ZeRO-2 over the 4), the same fault on its last
  rank; torchrun restarts every process and ``fit(resume=True)`` continues from the newest checkpoint.

Figures (issue 45):

* ``ft_committed_steps_lost``: over all faults, committed steps the job had to compute again (the last
  step committed before a fault minus the step training continued after, 0 when nothing is redone);
* ``ft_time_lost_vs_restart``: wall time lost per fault, ft over restart. Time lost by a fault: from the
  last commit before it to the first commit of a step not committed before it, less one median step;
  for ft plus the survivor's extra step time when it sends the state to the rejoining group;
* ``ft_rejoin_identical_fraction``: rejoins whose parameters equal the survivor's at every common step;
* ``ft_samples_exactly_once``: the fraction of the samples handed out that are in exactly one committed
  step, across all faults (the ft run);
* ``ft_step_overhead_no_fault``: the median step time of the ft job with no fault over the same
  processes as one job without replica groups (interleaved rounds). Both sides make the same
  collectives inside a group: ZeRO-2's reduce-scatter, and the loss all-reduce of the Trainer's
  non-finite check; the ft side adds the quorum, the cross-group average and ``should_commit``.

``--quick``: 2 faults, a small model, one no-fault round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
FEATURES, BATCH, INTERVAL = 64, 32, 10


# --- the worker: one process of either job ------------------------------------------------------
def pace(slow_file: str | None) -> None:
    """While a group restarts the other waits after its step's record (in no measured time) until the
    restarted one is about to join, then steps slowly until both train together."""
    if not slow_file or not os.path.exists(slow_file):
        return
    deadline = time.monotonic() + 300
    while os.path.exists(slow_file) and not os.path.exists(slow_file + ".ready") and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.path.exists(slow_file):
        time.sleep(0.3)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def worker(args: argparse.Namespace) -> None:
    import torch

    import trainmesh as tm

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, FEATURES, generator=generator)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, args.hidden)
    )
    model.append(torch.nn.Tanh()).append(torch.nn.Linear(args.hidden, 1))
    name = os.environ.get("TRAINMESH_REPLICA_GROUP", str(rank))
    log = open(f"{args.records}.{name}.{os.getpid()}.jsonl", "a")

    class Record(tm.Callback):
        def on_train_batch_begin(self, step, logs=None):
            if args.die_file and rank == world - 1 and os.path.exists(args.die_file):
                os.remove(args.die_file)  # one fault per file: the restarted process goes on

                # on the model's output: a hook on a ZeRO-sharded parameter never fires (FSDP2's backward
                # runs through the gathered one); this one fires as the backward starts
                def die(module, inputs, output):
                    output.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))

                self.trainer.unwrapped_model.register_forward_hook(die)

        def on_train_batch_end(self, step, logs=None):
            record = {
                "step": logs["global_step"],
                "rank": rank,
                "time": time.time(),
                "step_time_s": logs["step_time_s"],
                "healed": bool(logs.get("healed", False)),
                "replicas": logs.get("replicas", world),
                "samples": self.trainer._steps.last_indices,
            }
            if args.mode == "ft":
                params = self.trainer.unwrapped_model.parameters()
                # a ZeRO shard's full tensor: a collective every rank of the group makes
                record["param_sum"] = sum(_full(p).double().sum().item() for p in params)
            log.write(json.dumps(record) + "\n")
            log.flush()
            pace(args.slow_file)

        def on_train_begin(self, logs=None):
            if args.slow_file:  # this process is about to join: a waiting peer goes on (paced)
                open(args.slow_file + ".ready", "w").close()

    ft = None
    zero_stage = 2 if world > 1 else 0
    if args.mode == "ft":
        ft = tm.ReplicaGroups(min_replicas=1, advertise_host="127.0.0.1", timeout_s=10, connect_timeout_s=5)
    callbacks = [Record(), tm.ShardedCheckpoint(args.ckpt, every_n_steps=INTERVAL, async_save=False)]
    trainer = tm.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        torch.nn.MSELoss(),
        callbacks=callbacks,
        progress=False,
        zero_stage=zero_stage,
        fault_tolerance=ft,
    )
    trainer.fit(data, epochs=1, batch_size=BATCH, shuffle=True, resume=True)


# --- the driver ---------------------------------------------------------------------------------
def _records(prefix: str) -> dict[str, list[dict]]:
    """Every process's records, by file (one file per process incarnation)."""
    out = {}
    folder, base = os.path.split(prefix)
    for name in sorted(os.listdir(folder)):
        if name.startswith(base + ".") and name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as fh:
                out[name] = [json.loads(line) for line in fh if line.endswith("\n")]
    return out


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    return env


def _kill_family(proc: subprocess.Popen) -> None:
    """A launcher still running and its workers (torchrun starts each in its own session)."""
    if proc.poll() is not None:
        return
    import psutil

    for member in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def _wait(predicate, timeout_s: float, what: str, procs=()) -> None:
    from trainmesh.testing import wait_for

    wait_for(predicate, timeout_s, what, procs, poll_s=0.02)  # finer than tests: times are figures here


def _worker_argv(args, mode: str, folder: str, log: str, die: str | None = None, slow: str | None = None) -> list:
    argv = [HERE, "--worker", "--mode", mode, "--samples", str(args.samples), "--hidden", str(args.hidden)]
    argv += ["--records", log, "--ckpt", os.path.join(folder, "ckpt")]
    return argv + (["--die-file", die] if die else []) + (["--slow-file", slow] if slow else [])


def _max_step(prefix: str) -> int:
    return max((r["step"] for rs in _records(prefix).values() for r in rs), default=0)


def run_ft(args, folder: str, faults: int, rng: random.Random) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1500)
    url = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    log, slow = os.path.join(folder, "ft"), os.path.join(folder, "slow")
    procs: dict[int, subprocess.Popen] = {}
    outs = []

    def launch(group: int) -> None:
        out = open(os.path.join(folder, f"ft_g{group}_{len(outs)}.out"), "w")
        outs.append(out)
        die = os.path.join(folder, f"die{group}")
        argv = [sys.executable, "-m", "trainmesh", "run", "-n", str(args.group_size), "--replica-group", str(group)]
        argv += ["--lighthouse", url, *_worker_argv(args, "ft", folder, log, die, slow)]
        procs[group] = subprocess.Popen(argv, env=_env(), stdout=out, stderr=subprocess.STDOUT)

    fault_times, started = [], time.monotonic()
    together = lambda: _records_with(log, replicas=2, since=(fault_times or [0])[-1]) >= 1  # noqa: E731
    try:
        open(slow, "w").close()  # paced until both groups train together
        launch(0), launch(1)
        steps_total = args.samples // BATCH
        for _ in range(faults + 1):
            ended = lambda: all(p.poll() is not None for p in procs.values())  # noqa: E731
            _wait(lambda: together() or ended(), 300, "both groups in the quorum", procs.values())
            os.remove(slow)
            if ended():
                break
            target = _max_step(log) + rng.randint(3, 6)
            if len(fault_times) == faults or target + 40 > steps_total:
                break
            _wait(lambda: _max_step(log) >= target, 300, f"step {target}", procs.values())
            victim = rng.randint(0, 1)
            die = os.path.join(folder, f"die{victim}")
            open(die, "w").close()
            _wait(lambda: not os.path.exists(die), 120, "the victim to take the fault", procs.values())
            fault_times.append(time.time())
            procs[victim].wait(timeout=120)
            if os.path.exists(slow + ".ready"):
                os.remove(slow + ".ready")
            open(slow, "w").close()  # the survivor waits while the victim starts again
            launch(victim)
        for group, proc in procs.items():
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"ft group {group} exited {proc.returncode}: see {folder}")
    finally:
        for proc in procs.values():
            _kill_family(proc)
        for out in outs:
            out.close()
        lighthouse.shutdown()
    return {"records": _records(log), "fault_times": fault_times, "wall_s": time.monotonic() - started}


def _records_with(prefix: str, replicas: int, since: float) -> int:
    return sum(r["replicas"] == replicas and r["time"] > since for rs in _records(prefix).values() for r in rs)


def run_restart(args, folder: str, faults: int, rng: random.Random) -> dict:
    log, die = os.path.join(folder, "restart"), os.path.join(folder, "die")
    command = [sys.executable, "-m", "trainmesh", "run", "-n", str(2 * args.group_size), "--max-restarts", str(faults)]
    command += _worker_argv(args, "ddp", folder, log, die)
    started = time.monotonic()
    with open(os.path.join(folder, "restart.out"), "w") as out:
        proc = subprocess.Popen(command, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            fault_times: list[float] = []
            steps_total = args.samples // BATCH
            for _ in range(faults):
                target = _max_step(log) + rng.randint(3, 6)
                if target + 5 > steps_total:
                    break
                _wait(lambda: _max_step(log) >= target, 300, f"step {target}", [proc])
                open(die, "w").close()
                _wait(lambda: not os.path.exists(die), 120, "rank 1 to take the fault", [proc])
                fault_times.append(time.time())
                # the next fault after the restarted job has passed the step reached before this one
                reached = _max_step(log)
                _wait(lambda: _max_step(log) > reached, 300, "the restarted job past the fault", [proc])
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"the restart job exited {proc.returncode}: see {folder}")
        finally:
            _kill_family(proc)
    return {"records": _records(log), "fault_times": fault_times, "wall_s": time.monotonic() - started}


def run_clean(args, folder: str, mode: str) -> float:
    """Median step time of an unfaulted job (ft: two groups; ddp: trainmesh run -n 2)."""
    os.makedirs(folder)
    if mode == "ft":
        result = run_ft(args, folder, 0, random.Random(0))["records"]
    else:
        command = [sys.executable, "-m", "trainmesh", "run", "-n", str(2 * args.group_size)]
        command += _worker_argv(args, "ddp", folder, os.path.join(folder, "restart"))
        with open(os.path.join(folder, "ddp.out"), "w") as out:
            if subprocess.run(command, env=_env(), stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode:
                raise RuntimeError(f"the DDP job failed: see {folder}")
        result = _records(os.path.join(folder, "restart"))
    times = [r["step_time_s"] for rs in result.values() for r in rs[3:]]  # past the first steps' warm-up
    return statistics.median(times)


# --- the figures from the logs ------------------------------------------------------------------
def fault_losses(records: dict[str, list[dict]], fault_times: list[float], median_step: float) -> list[tuple]:
    """(committed steps lost, seconds lost) per fault. Before a fault: the newest step any process
    committed (its first commit time). After it: the first commit of a step not committed before;
    time lost is the time between, less one median step; steps lost, the newest step before less the
    first step committed after, plus one (0 when training went straight on)."""
    flat = sorted((r for rs in records.values() for r in rs), key=lambda r: r["time"])
    losses = []
    for t in fault_times:
        settled = t + 1.0  # records of the step before the fault land within this (the peer's included)
        newest = max(r["step"] for r in flat if r["time"] <= settled)
        newest_at = min(r["time"] for r in flat if r["step"] == newest and r["time"] <= settled)
        following = [r for r in flat if r["time"] > settled]
        after = next((r for r in following if r["step"] > newest), None)
        if after is None:
            continue
        first = min(r["step"] for r in following)
        losses.append((max(0, newest - first + 1), after["time"] - newest_at - median_step))
    return losses


def ft_figures(ft: dict, median_step: float) -> dict:
    records = ft["records"]
    by_step: dict[tuple, dict] = {}  # a group's ranks each hold their rows of the step's batch
    for rs in records.values():
        for r in rs:
            by_step.setdefault((r["step"], r["rank"]), r)
    # rejoins: processes that started healed after step 1; identical if equal to the others at every common step
    rejoins = [rs for rs in records.values() if rs and rs[0]["healed"] and rs[0]["step"] > 1]
    identical, heal_cost = 0, 0.0
    for rs in rejoins:
        others = [r for other in records.values() if other is not rs for r in other]
        sums = {r["step"]: r["param_sum"] for r in others}
        identical += all(r["param_sum"] == sums.get(r["step"], r["param_sum"]) for r in rs)
        sender = [r for r in others if r["step"] == rs[0]["step"]]  # the survivor's step that sent the state
        heal_cost += max(0.0, sender[0]["step_time_s"] - median_step) if sender else 0.0
    counts: dict[int, int] = {}
    for r in by_step.values():
        for i in r["samples"]:
            counts[i] = counts.get(i, 0) + 1
    losses = fault_losses(records, ft["fault_times"], median_step)
    faults = max(1, len(ft["fault_times"]))
    return {
        "lost_steps": sum(s for s, _ in losses),
        "time_lost_s": (sum(t for _, t in losses) + heal_cost) / faults,
        "heal_cost_s": heal_cost / faults,
        "faults_measured": len(losses),
        "rejoins": len(rejoins),
        "identical": identical,
        "exactly_once": sum(c == 1 for c in counts.values()) / max(1, len(counts)),
    }


def restart_figures(restart: dict, median_step: float) -> dict:
    losses = fault_losses(restart["records"], restart["fault_times"], median_step)
    return {
        "lost_steps": sum(s for s, _ in losses),
        "time_lost_s": sum(t for _, t in losses) / max(1, len(restart["fault_times"])),
        "faults_measured": len(losses),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved no-fault rounds (ft, DDP)")
    parser.add_argument("--quick", action="store_true", help="2 faults, a small model, 1 no-fault round")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=2, help="processes per replica group (ZeRO-2 if > 1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="ft", help=argparse.SUPPRESS)
    parser.add_argument("--records", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--die-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--slow-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.faults, args.rounds, args.hidden = 2, 1, 64
    if args.samples is None:
        args.samples = BATCH * (40 + 60 * args.faults)
    if args.worker:
        worker(args)
        return 0
    os.environ.setdefault("RUST_LOG", "warn")  # the in-process Lighthouse's log: before torchft is imported
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="replica_ft_") as tmp:
        overhead = []
        for i in range(args.rounds):  # interleaved: ft, DDP, ft, DDP ...
            clean_args = argparse.Namespace(**{**vars(args), "samples": BATCH * 60})
            ft_step = run_clean(clean_args, os.path.join(tmp, f"clean_ft{i}"), "ft")
            ddp_step = run_clean(clean_args, os.path.join(tmp, f"clean_ddp{i}"), "ddp")
            overhead.append((ft_step, ddp_step))
        median_step = statistics.median(d for _, d in overhead)
        os.makedirs(os.path.join(tmp, "ft"))
        os.makedirs(os.path.join(tmp, "restart"))
        ft = run_ft(args, os.path.join(tmp, "ft"), args.faults, random.Random(rng.random()))
        restart = run_restart(args, os.path.join(tmp, "restart"), args.faults, random.Random(rng.random()))
    f, r = ft_figures(ft, median_step), restart_figures(restart, median_step)
    deviation = [] if args.group_size == 2 else [f"groups of {args.group_size} processes (the issue: 2, ZeRO-2)"]
    if args.faults != 20:
        deviation.append(f"{len(ft['fault_times'])} faults (the issue: 20)")
    deviation = "; ".join(deviation) or "none"
    ratios = [a / b for a, b in overhead]
    figures = {
        "ft_committed_steps_lost": f["lost_steps"],
        "ft_time_lost_vs_restart": f["time_lost_s"] / r["time_lost_s"] if r["time_lost_s"] > 0 else float("nan"),
        "ft_rejoin_identical_fraction": f["identical"] / f["rejoins"] if f["rejoins"] else float("nan"),
        "ft_samples_exactly_once": f["exactly_once"],
        "ft_step_overhead_no_fault": statistics.median(ratios),
    }
    details = {
        "deviation": deviation,
        "faults": {"ft": len(ft["fault_times"]), "restart": len(restart["fault_times"])},
        "faults_measured": {"ft": f["faults_measured"], "restart": r["faults_measured"]},
        "ft_heal_cost_per_fault_s": f["heal_cost_s"],
        "time_lost_per_fault_s": {"ft": f["time_lost_s"], "restart": r["time_lost_s"]},
        "restart_lost_steps": r["lost_steps"],
        "rejoined_processes": f["rejoins"],  # each rank of a rejoining group
        "median_step_s": {"ft": statistics.median(a for a, _ in overhead), "ddp": median_step},
        "overhead_rounds": ratios,
        "hidden": args.hidden,
        "samples": args.samples,
        "load_avg_1min": os.getloadavg()[0],
    }
    print(f"deviation from the issue: {deviation}")
    print(f"{'figure':32s} {'value':>10s}")
    for name, value in figures.items():
        print(f"{name:32s} {value:10.3f}")
    print(json.dumps(details, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"figures": figures, "details": details}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
