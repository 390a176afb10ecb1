"""A chaos run: does a training job survive one fault at a random step with nothing lost?

    python benchmarks/chaos.py [--runs N] [--seed S] [--quick] [--nproc P] [--json PATH]

The job: 4 processes (`trainmesh run -n 4`, torchrun's elastic agent with restarts; ``--nproc 2``, the test
suite's smoke run, halves the process starts, each a torch import, and every fault kind strikes as with 4), an MLP
under ZeRO-2 with Adam, 2 epochs of 8 steps, ``tm.ShardedCheckpoint(every_n_steps=2, async_save=True)``
and ``fit(resume=True)``. One uninterrupted run is the reference. Every other run injects one fault,
chosen with ``--seed`` (kind, step, rank), in the first attempt:

* ``sigkill``: SIGKILL of a random rank after a random step;
* ``sigstop``: SIGSTOP of a random rank after a random step, SIGCONT once a peer has reported the
  hang (its ``CollectiveTimeoutError`` in the job's stderr), 2 collective timeouts after the stop at
  the latest (a long pause, not a death). Its peers block in the next collective until the collective
  timeout, when the hang detector (``comm/diagnosis.py``) names it; they exit, the agent stops the
  group and restarts it. (A rank left stopped would hold the agent in its 30 s grace period
  before SIGKILL: a stopped process does not act on SIGTERM.)
* ``corrupt``: a flipped byte in, or a truncation of, one file of the newest complete checkpoint
  (its completion marker included), then a crash
  (SIGKILL of rank 0), so that the restart has to read it;
* ``disk_full``: the checkpoint directory is a small tmpfs mounted for the run (needs root; else
  the kind is skipped, the reason recorded). After a random step the disk is filled up; the next
  save fails to write, every rank hears it at the step after it, a warning names the path and the
  free space, the previous checkpoint is kept and training goes on (no crash, no restart);
  ``INTERVAL + 1`` steps after the fill (an operator freeing space) rank 0 deletes the filler and
  later saves commit again. ``not_saved`` counts the saves reported as not saved;
* ``kill_during_save``: SIGKILL in a save, at a random save step: phase ``write`` kills a random
  rank while its asynchronous write is in flight (uncommitted), phase ``commit`` kills rank 0
  inside the commit, after the marker is written and before the directory is renamed into place.

Per run: are the final parameters bit-identical to the reference (``torch.equal``)? Steps
recomputed: for each restart, the last step any process completed (a fsynced sample log) minus
the step the next attempt resumed at. A corrupted checkpoint's own steps are destroyed by the fault
itself, not lost by the recovery: ``lost_steps`` is the recomputed steps less those (the steps
between the corrupted checkpoint and the newest older one), and ``recomputed_steps`` keeps the raw
count. A *silent fresh start* is an attempt after the first that resumed at step 0 while complete
checkpoints existed, without the "starting over" line.

Figures (issue 35): ``chaos_identical_fraction`` (goal 1.0), ``chaos_max_lost_steps`` (goal <= the
checkpoint interval, 2), ``chaos_silent_fresh_starts`` (goal 0); ``chaos_runs`` and
``chaos_max_recomputed_steps`` for context. ``--quick`` runs every kind once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the parts beside it, when loaded by path
from chaos_analysis import analyse, read_logs  # noqa: E402
from chaos_job import GLOBAL_BATCH, HANG_TIMEOUT_S, INTERVAL, KINDS, NPROC, TMPFS_MB, TOTAL_STEPS, worker  # noqa: E402
from chaos_launch import _launch  # noqa: E402


# --------------------------------------------------------------------------- the driver
def plan_runs(
    runs: int, seed: int, quick: bool, kinds_allowed: tuple[str, ...] = KINDS, nproc: int = NPROC
) -> list[dict]:
    """Each run's fault: kind, step (after which it strikes), rank (of ``nproc``), phase; seeded."""
    rng = random.Random(seed)
    if quick:
        kinds = list(kinds_allowed)
    else:  # every kind equally often, in a seeded order
        kinds = [kinds_allowed[i % len(kinds_allowed)] for i in range(runs)]
        rng.shuffle(kinds)
    save_steps = [s for s in range(2 * INTERVAL, TOTAL_STEPS - INTERVAL + 1, INTERVAL)]
    plans = []
    for kind in kinds:
        plan = {"kind": kind, "rank": rng.randrange(nproc), "phase": "-", "seed": rng.randrange(1 << 30)}
        if kind == "corrupt":  # two committed checkpoints: one to destroy, an older one to fall back to (an
            # async save commits by the next save at the latest: from step 3 intervals on there are two)
            plan.update(step=rng.randint(3 * INTERVAL, TOTAL_STEPS - 1), rank=0)
        elif kind == "disk_full":  # a checkpoint to fall back to, and a save to fail, after it
            plan.update(step=rng.randint(2 * INTERVAL + 1, TOTAL_STEPS - INTERVAL), rank=0)
        elif kind == "kill_during_save":
            # --quick: the commit (marker written, not renamed into place); a kill in the write is
            # much like a sigkill at a save step
            plan.update(step=rng.choice(save_steps), phase="commit" if quick else rng.choice(["write", "commit"]))
            if plan["phase"] == "commit":
                plan["rank"] = 0  # rank 0 commits
        else:  # late enough for a committed checkpoint to resume from (an async save commits by the next save)
            plan["step"] = rng.randint(2 * INTERVAL + 1, TOTAL_STEPS - 1)
        plans.append(plan)
    return plans


def _mount_tmpfs(path: str) -> str | None:
    """Mount a TMPFS_MB tmpfs at ``path``; None on success, else why not."""
    if not sys.platform.startswith("linux"):
        return "needs Linux (a tmpfs mount)"
    if os.geteuid() != 0:
        return "needs root to mount a size-limited tmpfs"
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", path], capture_output=True, text=True, timeout=30
    )
    return None if proc.returncode == 0 else f"mount -t tmpfs failed: {proc.stderr.strip()[:200]}"


def _unmount(path: str) -> None:
    subprocess.run(["umount", path], capture_output=True, timeout=60)


def run_one(root: str, index: int, plan: dict, reference: dict | None, timeout_s: float, nproc: int = NPROC) -> dict:
    out = os.path.join(root, f"run{index:02d}_{plan['kind']}")
    os.makedirs(out)
    ckpt_parent = os.path.join(out, "disk")
    os.makedirs(ckpt_parent)
    mounted = False
    if plan["kind"] == "disk_full":
        reason = _mount_tmpfs(ckpt_parent)
        if reason is not None:
            return {**plan, "skipped": reason}
        mounted = True
    try:
        launch = _launch(out, os.path.join(ckpt_parent, "ckpt"), plan, timeout_s, nproc)
    finally:
        if mounted:
            _unmount(ckpt_parent)
    result = analyse(plan, launch, read_logs(out), reference, out)
    if result["exit_code"] != 0 or not result["identical"]:
        result["stderr_tail"] = launch["stderr"][-2500:]
    return result


def figures_of(results: list[dict]) -> dict:
    done = [r for r in results if "skipped" not in r]
    return {
        "chaos_identical_fraction": round(sum(r["identical"] for r in done) / len(done), 4) if done else 0.0,
        "chaos_max_lost_steps": max((r["lost_steps"] for r in done), default=0),
        "chaos_silent_fresh_starts": sum(r["silent_fresh_starts"] for r in done),
        "chaos_max_recomputed_steps": max((r["recomputed_steps"] for r in done), default=0),
        "chaos_runs": len(done),
    }


def table(results: list[dict]) -> str:
    head = (
        f"{'#':>2} {'fault':<17} {'phase':<6} {'step':>4} {'rank':>4} {'exit':>4} {'tries':>5} "
        f"{'resumed':>8} {'recomp':>6} {'lost':>4} {'ident':>5} {'silent':>6} {'sec':>5}  note"
    )
    lines = [head, "-" * len(head)]
    for i, r in enumerate(results):
        if "skipped" in r:
            lines.append(f"{i:>2} {r['kind']:<17} {'':<6} {'':>4} {'':>4} skipped: {r['skipped']}")
            continue
        note = []
        if r["kind"] == "sigstop":
            note.append("hang named" if r["hang_named"] else "hang NOT named")
        if r["destroyed_steps"]:
            note.append(f"{r['destroyed_steps']} destroyed by the corruption")
        if not r["resumed_newest_valid"]:
            note.append(f"resumed BEFORE the newest valid checkpoint ({r['newest_valid']})")
        if r["skipped_warnings"]:
            note.append(f"{r['skipped_warnings']} skip warning(s)")
        if r.get("not_saved"):
            note.append(f"{r['not_saved']} save(s) reported not saved")
        if r["no_valid_checkpoint_error"]:
            note.append("stopped: NoValidCheckpointError")
        if r["timed_out"]:
            note.append("TIMED OUT")
        lines.append(
            f"{i:>2} {r['kind']:<17} {r['phase']:<6} {r['step']:>4} {r['rank']:>4} {r['exit_code']:>4} "
            f"{r['attempts']:>5} {','.join(map(str, r['resumed_at'][1:])) or '-':>8} "
            f"{r['recomputed_steps']:>6} {r['lost_steps']:>4} {'yes' if r['identical'] else 'NO':>5} "
            f"{r['silent_fresh_starts']:>6} {r['seconds']:>5.0f}  {'; '.join(note)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="faulty runs (--quick: one per kind)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="every fault kind once")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--dir", default=None, help="keep the runs here (default: a temp dir, removed)")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma list of fault kinds (default: all: {','.join(KINDS)})"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job before it counts as hung")
    parser.add_argument("--nproc", type=int, default=NPROC, help=f"processes per job (default {NPROC})")
    # the job's own arguments (run by `trainmesh run`)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--fault", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--fault-step", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--fault-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="-", help=argparse.SUPPRESS)
    parser.add_argument("--fault-seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.runs < 1:
        parser.error(f"--runs must be >= 1. Received: --runs {args.runs}")
    if args.nproc < 2 or GLOBAL_BATCH % args.nproc:  # a fault needs a peer; the global batch splits evenly
        parser.error(f"--nproc must be >= 2 and divide the global batch {GLOBAL_BATCH}. Received: --nproc {args.nproc}")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or any(k not in KINDS for k in kinds):
        parser.error(f"--kinds must name kinds among {KINDS}. Received: --kinds {args.kinds}")
    import torch

    plans = plan_runs(args.runs, args.seed, args.quick, kinds, args.nproc)
    root = args.dir or tempfile.mkdtemp(prefix="trainmesh-chaos-")
    os.makedirs(root, exist_ok=True)
    started = time.monotonic()
    try:
        ref_plan = {"kind": "none", "rank": 0, "phase": "-", "seed": 0, "step": 0}
        ref = run_one(root, 0, ref_plan, None, args.timeout, args.nproc)
        ref_final = os.path.join(root, "run00_none", "final.pt")
        if ref["exit_code"] != 0 or not os.path.exists(ref_final):
            print(f"INVALID: the uninterrupted run failed (exit {ref['exit_code']}):\n{ref.get('stderr_tail', '')}")
            return 1
        reference = torch.load(ref_final, weights_only=True)
        results = []
        for i, plan in enumerate(plans, start=1):
            result = run_one(root, i, plan, reference, args.timeout, args.nproc)
            results.append(result)
            print(table(results).splitlines()[-1], flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    figures = figures_of(results)
    print()
    print(
        f"uninterrupted run: {ref['seconds']:.0f} s, resumed at {ref['resumed_at']}; checkpoint interval "
        f"{INTERVAL} steps, {TOTAL_STEPS} steps, {args.nproc} processes, ZeRO-2, async sharded checkpoints; steps "
        f"from a save to its commit: {ref['commit_lag_steps']}"
    )
    print(table(results))
    print()
    for name, value in figures.items():
        print(f"{name:<28} {value}")
    total = time.monotonic() - started
    print(f"total {total:.0f} s")
    report = {
        "figures": figures,
        "settings": {
            "nproc": args.nproc,
            "zero_stage": 2,
            "checkpoint_interval": INTERVAL,
            "total_steps": TOTAL_STEPS,
            "global_batch": GLOBAL_BATCH,
            "hang_timeout_s": HANG_TIMEOUT_S,
            "seed": args.seed,
            "quick": args.quick,
            "tmpfs_mb": TMPFS_MB,
        },
        "reference_seconds": ref["seconds"],
        "reference_commit_lag_steps": ref["commit_lag_steps"],
        "seconds": round(total, 1),
        "runs": results,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
