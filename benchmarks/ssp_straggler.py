"""Parameter-server SSP vs sync with a straggler HOST: time to a target loss (communication.py's SSP part).

    python benchmarks/ssp_straggler.py [--rounds R] [--quick] [--json PATH]   (or communication.py --ssp-only)

Needs root (CAP_NET_ADMIN) for ``trainmesh.testing.cluster``: 3 hosts (network namespaces on a
bridge, 198.18.0.0/24). Host 0 runs one parameter server (``trainmesh ps-server``); hosts 1 and 2
each run one worker (``trainmesh run --nnodes 2 --nproc-per-node 1``, c10d rendezvous at host 1),
``tm.ParameterServerStrategy`` finding the server in ``TRAINMESH_PS_SERVERS``. Host 2 is the
straggler: its link is shaped to ``--rate`` in both directions (tc tbf; this kernel has no netem,
so a slow link rather than a far one). Hosts 0 and 1 are unshaped.

Task: linear regression, a 2048 x 256 weight (2 MiB of fp32, pushed and pulled whole every step),
batches of 64 per worker, plain SGD at the same lr, the same seeds and the same budget (every
worker takes ``steps`` steps) for ``sync`` and ``ssp:K``, one fresh server per run, the two modes
interleaved (the order alternates per round). Each worker evaluates a fixed held-out set with
the parameters it computes each step with; a run's time to target is the later of the two
workers' first times at or below ``TARGET_FRACTION`` x the initial loss.

Why it pays here: under sync every step puts a push and then a pull of the whole model over the
slow link on the critical path of both workers (about 2 x model / rate). Under SSP the straggler
leaves its pushes in flight and computes on its cached copy (fresh enough while clock - K <= the
servers' min clock), so its uplink streams pushes while its downlink streams the next copy:
about model / rate per step. The fast worker runs at most K steps ahead of it.
Why it does not pay with a persistently slower *compute* worker (``persistent`` in
communication.py's extras): the bound holds the fast worker at the straggler's clock + K, each
worker pushes gradient / N, so the total progress per second is the straggler's rate in both
modes; SSP only absorbs transient delays.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from trainmesh.testing.stats import ci95

HERE = Path(__file__).resolve()
IN_DIM, OUT_DIM, BATCH, EVAL, LR, TARGET_FRACTION = 256, 2048, 64, 128, 0.02, 0.1
MODES = ("sync", "ssp:3")
SERVER_PORT, RDZV_PORT = 5711, 29531
SECRET = "ssp-straggler-benchmark"


# --- the worker: this file run under `trainmesh run` in hosts 1 and 2 --------------------------
def _task(rank: int):
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(OUT_DIM, IN_DIM, generator=g) / IN_DIM**0.5
    x_eval = torch.randn(EVAL, IN_DIM, generator=g)
    return teacher, x_eval, x_eval @ teacher.T, torch.Generator().manual_seed(100 + rank)


def _loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target) ** 2).sum(1).mean()


def job(cfg: dict) -> None:
    import torch.distributed as dist

    import trainmesh as tm

    tm.initialize()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    teacher, x_eval, y_eval, gen = _task(rank)
    model = nn.Linear(IN_DIM, OUT_DIM, bias=False)
    nn.init.zeros_(model.weight)
    strategy = tm.ParameterServerStrategy(mode=cfg["mode"])
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    dist.barrier()  # both registered and pulled: the clock starts for both at once
    started, seconds, losses = time.perf_counter(), [], []
    for _ in range(cfg["steps"]):
        with torch.no_grad():  # the parameters this step computes with
            losses.append(float(_loss(model(x_eval), y_eval)))
        seconds.append(time.perf_counter() - started)
        x = torch.randn(BATCH, IN_DIM, generator=gen)
        loss = _loss(model(x), x @ teacher.T)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    optimizer.flush()
    seconds.append(time.perf_counter() - started)
    cache = strategy.dense_cache
    result = {
        "rank": rank,
        "host": int(os.environ["SSP_BENCH_HOST"]),
        "mode": cfg["mode"],
        "seconds": seconds,
        "losses": losses,
        "steps": cfg["steps"],
        "blocking_pulls": cache.blocking_pulls if cache else cfg["steps"],
        "max_lead": cache.max_lead if cache else 0,
        "server_max_staleness": max(s["max_staleness_observed"] for s in strategy.stats()["servers"]),
    }
    strategy.close()  # a barrier: the fast worker waits here for the straggler's last steps
    with open(os.path.join(cfg["out"], f"{cfg['tag']}-rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    tm.shutdown()


# --- the driver ----------------------------------------------------------------------------------
def _start_server(host) -> subprocess.Popen:
    address = f"tcp://{host.address}:{SERVER_PORT}"
    proc = host.popen(
        [
            sys.executable,
            "-m",
            "trainmesh",
            "ps-server",
            "--bind",
            address,
            "--num-workers",
            "2",
            "--dead-after-s",
            "30",
        ],
        env={"TRAINMESH_PS_SECRET": SECRET, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != f"READY {address}":
        proc.kill()
        raise RuntimeError(f"parameter server did not start: {line}{proc.communicate()[0][-2000:]}")
    return proc


def one_run(cluster, mode: str, steps: int, tag: str, out: str) -> list[dict]:
    server_host, workers = cluster.hosts[0], cluster.hosts[1:]
    server = _start_server(server_host)
    try:
        cfg = json.dumps({"mode": mode, "steps": steps, "tag": tag, "out": out})
        endpoint = f"{workers[0].address}:{RDZV_PORT}"
        env = {
            "OMP_NUM_THREADS": "1",
            "TRAINMESH_TIMEOUT_S": "300",
            "TRAINMESH_PS_SECRET": SECRET,
            "TRAINMESH_PS_SERVERS": f"tcp://{server_host.address}:{SERVER_PORT}",
        }
        procs = [
            host.popen(
                [
                    sys.executable,
                    "-m",
                    "trainmesh",
                    "run",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--node-rank",
                    str(i),
                    "--rdzv-endpoint",
                    endpoint,
                    "--rdzv-id",
                    tag,
                    str(HERE),
                    "--job",
                    cfg,
                ],
                env={**env, "SSP_BENCH_HOST": str(host.index)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i, host in enumerate(workers)
        ]
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=600)[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append(proc.communicate()[0])
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{tag}: a worker failed:\n" + "\n".join(o[-3000:] for o in outputs))
    finally:
        server.terminate()
        server.communicate(timeout=30)
    return sorted(
        (json.loads((Path(out) / f"{tag}-rank{r}.json").read_text()) for r in range(2)), key=lambda r: r["host"]
    )


def time_to_target(run: list[dict]) -> tuple[float | None, int | None]:
    """(seconds, steps) until both workers computed with parameters at or below the target loss."""
    initial = run[0]["losses"][0]
    target = TARGET_FRACTION * initial
    seconds, steps = [], []
    for worker in run:
        hit = next((i for i, loss in enumerate(worker["losses"]) if loss <= target), None)
        if hit is None:
            return None, None
        seconds.append(worker["seconds"][hit])
        steps.append(hit)
    return max(seconds), max(steps)


def ssp_host_part(rounds: int, steps: int, rate: str) -> dict:
    """Runs on a fresh 3-host cluster; returns the runs, per-mode medians and the ratio figure."""
    from trainmesh.testing.cluster import Cluster

    runs: dict[str, list] = {m: [] for m in MODES}
    with Cluster(3) as cluster, tempfile.TemporaryDirectory() as out:
        cluster.wait_reachable()
        cluster.hosts[2].shape(rate=rate)  # the straggler host
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                run = one_run(cluster, mode, steps, f"r{r}-{mode.replace(':', '')}", out)
                seconds, to_target = time_to_target(run)
                straggler = run[1]
                runs[mode].append(
                    {
                        "seconds": seconds,
                        "steps_to_target": to_target,
                        "s_per_step": straggler["seconds"][-1] / steps,
                        "straggler_blocking_pulls_per_step": straggler["blocking_pulls"] / steps,
                        "max_lead": max(w["max_lead"] for w in run),
                        "server_max_staleness": max(w["server_max_staleness"] for w in run),
                        "initial_loss": run[0]["losses"][0],
                        "final_loss": min(w["losses"][-1] for w in run),
                    }
                )
        cluster.hosts[2].unshape()
    return summarize(runs, rounds, steps, rate)


def summarize(runs: dict, rounds: int, steps: int, rate: str) -> dict:
    sync, ssp = runs[MODES[0]], runs[MODES[1]]
    valid = all(r["seconds"] is not None for r in sync + ssp)
    ratios = [b["seconds"] / a["seconds"] for a, b in zip(sync, ssp)] if valid else []
    # the bound held: no worker computed with values staler than K, by the client's and the server's count
    bound = int(MODES[1].split(":")[1])
    valid = valid and all(r["max_lead"] <= bound and r["server_max_staleness"] <= bound for r in ssp)
    out = {
        "runs": runs,
        "rounds": rounds,
        "steps": steps,
        "rate": rate,
        "valid": valid,
        "ratio": statistics.median(ratios) if ratios else float("inf"),
        "ratio_ci95": list(_median_ci(ratios)) if ratios else None,
    }
    print(
        f"\nparameter server, straggler HOST (link {rate}), 1 server + 2 worker hosts, {steps} steps each, "
        f"time to {TARGET_FRACTION} x initial loss ({rounds} interleaved rounds):"
    )
    header = (
        f"{'mode':<8}{'to target s':>13}{'steps':>7}{'s/step':>8}{'blocking pulls/step':>21}"
        f"{'max lead':>10}{'final loss':>12}"
    )
    print(header + "\n" + "-" * len(header))
    for mode in MODES:
        rows = runs[mode]
        med = statistics.median([r["seconds"] or float("inf") for r in rows])
        print(
            f"{mode:<8}{med:>13.2f}{statistics.median([r['steps_to_target'] or -1 for r in rows]):>7}"
            f"{statistics.median([r['s_per_step'] for r in rows]):>8.3f}"
            f"{statistics.median([r['straggler_blocking_pulls_per_step'] for r in rows]):>21.2f}"
            f"{max(r['max_lead'] for r in rows):>10}{statistics.median([r['final_loss'] for r in rows]):>12.4f}"
        )
    lo, hi = out["ratio_ci95"] or (float("nan"), float("nan"))
    print(
        f"{MODES[1]} / sync time to target: {out['ratio']:.3f} (95% interval {lo:.3f}-{hi:.3f})"
        + ("" if valid else "  INVALID (a run missed the target or broke the bound)")
    )
    return out


def _median_ci(ratios: list[float]) -> tuple[float, float]:
    """95% interval of the median: a bootstrap over rounds (the spread itself with fewer than 3)."""
    if len(ratios) < 3:
        return min(ratios), max(ratios)
    rng = random.Random(0)
    return ci95([statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(1000)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.job:
        job(json.loads(args.job))
        return 0
    result = ssp_host_part(args.rounds or (1 if args.quick else 3), args.steps or (40 if args.quick else 60), args.rate)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"figures": {"ssp_time_to_loss_vs_sync_straggler_host": result["ratio"]}, "ssp": result}, fh, indent=1
            )
    if not result["valid"]:
        print("INVALID")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
