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
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
KINDS = ("sigkill", "sigstop", "corrupt", "disk_full", "kill_during_save")
NPROC = 4
GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS, INTERVAL = 16, 8, 2, 2
TOTAL_STEPS = STEPS_PER_EPOCH * EPOCHS
HANG_TIMEOUT_S = 10  # the collective timeout of a sigstop run: how soon the hang detector fires
TIMEOUT_S = 60  # the collective timeout of every other run
TMPFS_MB = 8
FILLER = "filler.bin"


# --------------------------------------------------------------------------- the job (one rank)
def _log(path: str, line: str) -> None:
    from trainmesh.testing.sample_log import append_durably

    append_durably(path, line)


def _complete_steps(ckpt: str) -> list[int]:
    """Steps of the checkpoint directories with a completion marker (no checksum pass)."""
    from trainmesh.checkpoint import integrity

    if not os.path.isdir(ckpt):
        return []
    names = os.listdir(ckpt)
    return sorted(
        integrity.parse_step(n)
        for n in names
        if integrity.parse_step(n) is not None and os.path.exists(os.path.join(ckpt, n, integrity.MARKER))
    )


def _corrupt(ckpt: str, rng: random.Random) -> str:
    """Flip a byte in, or truncate, one file (the marker included) of the newest complete checkpoint."""
    from trainmesh.checkpoint import integrity

    newest = os.path.join(ckpt, integrity.step_dirname(_complete_steps(ckpt)[-1]))
    files = sorted(os.path.relpath(os.path.join(r, f), newest) for r, _, fs in os.walk(newest) for f in fs)
    rel = rng.choice(files)
    path = os.path.join(newest, rel)
    with open(path, "r+b") as fh:
        size = os.fstat(fh.fileno()).st_size
        pos = rng.randrange(size)
        if rng.random() < 0.5:
            fh.truncate(pos)
            how = f"truncated to {pos} of {size} bytes"
        else:
            fh.seek(pos)
            byte = fh.read(1)
            fh.seek(pos)
            fh.write(bytes([byte[0] ^ 0xFF]))
            how = f"byte {pos} of {size} flipped"
        fh.flush()
        os.fsync(fh.fileno())
    return f"{os.path.basename(newest)}/{rel} {how}"


def _fill_disk(ckpt: str) -> int:
    """Fill the checkpoint file system up, leaving a few KiB (metadata fits, shards do not)."""
    free = os.statvfs(ckpt).f_bavail * os.statvfs(ckpt).f_frsize
    size = max(0, free - (8 << 10))
    with open(os.path.join(ckpt, "..", FILLER), "wb") as fh:
        chunk = b"\0" * (1 << 20)
        left = size
        try:
            while left > 0:
                left -= fh.write(chunk[: min(left, len(chunk))])
        except OSError:
            pass  # full already
        fh.flush()
    return size


def worker(args: argparse.Namespace) -> None:
    import torch

    import trainmesh as tm
    from trainmesh.testing.sample_log import SampleLog

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    filler = os.path.join(args.ckpt, "..", FILLER)
    if restart > 0 and local_rank == 0 and os.path.exists(filler):
        os.remove(filler)  # an operator freed space; before the rendezvous, so before any rank saves
    tm.initialize()
    torch.set_num_threads(1)
    rank = tm.rank()
    log = os.path.join(args.out, f"log.rank{rank}")
    armed = restart == 0 and args.fault != "none"
    _log(log, f"PID {restart} {os.getpid()}")  # the driver makes sure no process outlives the run
    if rank == 0:
        _log(log, f"SURVEY {restart} {' '.join(map(str, _complete_steps(args.ckpt)))}")

    if armed and args.fault == "kill_during_save" and args.phase == "commit" and rank == 0:
        from trainmesh.checkpoint import integrity

        seal = integrity.seal

        def seal_then_die(tmp_dir, final_dir, info):
            if info["step"] == args.fault_step:  # the marker is written, the rename never happens
                integrity.write_json_atomic(
                    os.path.join(tmp_dir, integrity.MARKER), {**info, "files": integrity.file_checksums(tmp_dir)}
                )
                _log(log, f"FAULT {restart} kill_during_save commit {info['step']} rank0")
                os.kill(os.getpid(), signal.SIGKILL)
            return seal(tmp_dir, final_dir, info)

        integrity.seal = seal_then_die

    g = torch.Generator().manual_seed(0)
    n = GLOBAL_BATCH * STEPS_PER_EPOCH
    data = (torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
    )
    checkpoint = tm.ShardedCheckpoint(args.ckpt, every_n_steps=INTERVAL, async_save=True)

    class Fault(tm.Callback):  # after the checkpoint's own callback: a step's save has started
        committed = set(_complete_steps(args.ckpt))

        def on_train_batch_end(self, step, logs=None):
            s = self.trainer.global_step
            if rank == 0:  # when each save committed (the async commit lag, in steps)
                for c in sorted(set(_complete_steps(args.ckpt)) - self.committed):
                    _log(log, f"COMMIT {restart} {c} {s}")
                    self.committed.add(c)
            if not armed or s != args.fault_step:
                return
            kind = args.fault
            if kind in ("sigkill", "sigstop") and rank == args.fault_rank:
                _log(log, f"FAULT {restart} {kind} {s} rank{rank}")
                if kind == "sigstop":
                    with open(os.path.join(args.out, "stopped.pid"), "w") as fh:
                        fh.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP if kind == "sigstop" else signal.SIGKILL)
            elif kind == "corrupt" and rank == 0:
                what = _corrupt(args.ckpt, random.Random(args.fault_seed))
                _log(log, f"FAULT {restart} corrupt {s} {what}")
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "disk_full" and rank == 0:
                _log(log, f"FAULT {restart} disk_full {s} filled={_fill_disk(args.ckpt)}")
            elif kind == "kill_during_save" and args.phase == "write" and rank == args.fault_rank:
                pending = checkpoint.manager._pending
                in_flight = pending is not None and not pending.done()
                _log(log, f"FAULT {restart} kill_during_save write {s} rank{rank} in_flight={int(in_flight)}")
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_begin(self, step, logs=None):
            s = self.trainer.global_step  # steps done so far
            if armed and args.fault == "disk_full" and rank == 0 and s == args.fault_step + INTERVAL + 1:
                os.remove(os.path.join(args.ckpt, "..", FILLER))  # the failed save was agreed on by now
                _log(log, f"FREED {restart} {s} not_saved={len(checkpoint.manager.failures)}")

    trainer = tm.Trainer(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        torch.nn.MSELoss(),
        zero_stage=2,
        callbacks=[SampleLog(log, str(restart)), checkpoint, Fault()],
        progress=False,
    )
    trainer.fit(data, epochs=EPOCHS, batch_size=GLOBAL_BATCH, resume=True)
    final = trainer.state_dict()["model"]
    if rank == 0:
        torch.save(final, os.path.join(args.out, "final.pt"))
    tm.shutdown()


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


def _launch(out: str, ckpt: str, plan: dict, timeout_s: float, nproc: int) -> dict:
    """One `trainmesh run -n nproc` job (with restarts) until it exits; a stopped rank gets SIGCONT once a
    peer's CollectiveTimeoutError is in the job's stderr, or 2 collective timeouts after it stopped."""
    hang_timeout = HANG_TIMEOUT_S if plan["kind"] == "sigstop" else TIMEOUT_S
    cmd = [
        sys.executable,
        "-m",
        "trainmesh",
        "run",
        "-n",
        str(nproc),
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.2",
        HERE,
        "--worker",
        "--out",
        out,
        "--ckpt",
        ckpt,
        "--fault",
        plan["kind"],
        "--fault-step",
        str(plan.get("step", 0)),
        "--fault-rank",
        str(plan["rank"]),
        "--phase",
        plan["phase"],
        "--fault-seed",
        str(plan["seed"]),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    env.update(TRAINMESH_TIMEOUT_S=str(hang_timeout), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    stopped_at, continued, continued_after = None, False, None
    with open(os.path.join(out, "stdout.txt"), "w") as so, open(os.path.join(out, "stderr.txt"), "w") as se:
        proc = subprocess.Popen(cmd, env=env, stdout=so, stderr=se, start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                pid_file = os.path.join(out, "stopped.pid")
                if stopped_at is None and os.path.exists(pid_file):
                    stopped_at = time.monotonic()
                # Continued as soon as the hang is reported: waiting on to 2 timeouts held the agent that long in
                # its SIGTERM grace period for the stopped rank (~10 s a sigstop run), and proved nothing more.
                if (
                    stopped_at is not None
                    and not continued
                    and (time.monotonic() - stopped_at > 2 * hang_timeout or _hang_reported(out))
                ):
                    continued = _continue(pid_file)
                    if continued:  # seconds the rank stayed stopped (as seen by this loop)
                        continued_after = round(time.monotonic() - stopped_at, 1)
                if time.monotonic() - started > timeout_s:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:  # the agent and its workers (in sessions of their own)
                for pid in [*_descendants(proc.pid), proc.pid]:
                    _kill(pid)
                proc.wait()
    for pid in _worker_pids(out):  # e.g. a stopped rank the agent failed to end
        _kill(pid, only_if=HERE)
    with open(os.path.join(out, "stdout.txt")) as fh:
        stdout = fh.read()
    with open(os.path.join(out, "stderr.txt")) as fh:
        stderr = fh.read()
    return {
        "exit_code": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - started, 1),
        "sigcont_sent": continued,
        "sigcont_after_s": continued_after,
        "stdout": stdout,
        "stderr": stderr,
    }


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _worker_pids(out: str) -> list[int]:
    pids = []
    for name in os.listdir(out):
        if name.startswith("log.rank"):
            with open(os.path.join(out, name)) as fh:
                pids += [int(line.split()[2]) for line in fh if line.startswith("PID ")]
    return pids


def _kill(pid: int, only_if: str | None = None) -> None:
    """SIGKILL ``pid`` (a process this driver started), if it still runs ``only_if`` (a script path)."""
    try:
        if only_if is not None:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if only_if.encode() not in fh.read():
                    return
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def _hang_reported(out: str) -> bool:
    """A peer of the stopped rank has raised its CollectiveTimeoutError (printed to the job's stderr)."""
    try:
        with open(os.path.join(out, "stderr.txt")) as fh:
            return "CollectiveTimeoutError" in fh.read()
    except OSError:
        return False


def _continue(pid_file: str) -> bool:
    try:
        pid = int(open(pid_file).read())
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        if state == "T" and HERE in open(f"/proc/{pid}/cmdline").read():
            os.kill(pid, signal.SIGCONT)
            return True
    except (OSError, ValueError):
        pass
    return False


def read_logs(out: str) -> dict:
    """Attempts (restart count -> resume step, last completed step), surveys and faults."""
    resume, last, survey, faults, lag = {}, {}, {}, [], []
    for name in sorted(os.listdir(out)):
        if not name.startswith("log.rank"):
            continue
        with open(os.path.join(out, name)) as fh:
            for parts in (line.split() for line in fh if line.strip()):
                attempt = int(parts[1])
                if parts[0] == "RESUME":
                    resume.setdefault(attempt, set()).add(int(parts[2]))
                elif parts[0] == "STEP":
                    last[attempt] = max(last.get(attempt, 0), int(parts[3]))
                elif parts[0] == "SURVEY":
                    survey[attempt] = [int(x) for x in parts[2:]]
                elif parts[0] == "FAULT":
                    faults.append(" ".join(parts[2:]))
                elif parts[0] == "COMMIT":
                    lag.append(int(parts[3]) - int(parts[2]))
    return {
        "resume": {k: sorted(v) for k, v in resume.items()},
        "last": last,
        "survey": survey,
        "faults": faults,
        "commit_lag": lag,
    }


def analyse(plan: dict, launch: dict, logs: dict, reference: dict | None, out: str) -> dict:
    import torch

    attempts = sorted(logs["resume"])
    recomputed, destroyed, silent, fresh_with_ckpts = 0, 0, 0, 0
    said_start_over = "starting over" in launch["stdout"]
    for prev, nxt in zip(attempts, attempts[1:]):
        at = logs["resume"][nxt]
        at = max(at)
        recomputed += max(0, logs["last"].get(prev, 0) - at)
        existing = logs["survey"].get(nxt, [])
        if at == 0 and existing:
            fresh_with_ckpts += 1
            silent += 0 if said_start_over else 1
    corrupted = [
        int(re.match(r"corrupt \d+ step_(\d+)/", f).group(1)) for f in logs["faults"] if f.startswith("corrupt")
    ]
    if corrupted and len(attempts) > 1:
        older = [s for s in logs["survey"].get(attempts[1], []) if s < corrupted[0]]
        destroyed = corrupted[0] - (max(older) if older else 0)
    # The checkpoint the restart should have chosen: the newest complete one it found, less a corrupted one.
    first_restart = logs["survey"].get(attempts[1], []) if len(attempts) > 1 else []
    valid = [s for s in first_restart if s not in corrupted]
    newest_valid = max(valid) if valid else 0
    identical, max_abs_diff = False, None
    final_path = os.path.join(out, "final.pt")
    if reference is not None and os.path.exists(final_path):
        final = torch.load(final_path, weights_only=True)
        identical = final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)
        max_abs_diff = (
            max(float((final[k] - reference[k]).abs().max()) for k in reference)
            if final.keys() == reference.keys()
            else None
        )
    hang_named = None
    if plan["kind"] == "sigstop":
        hang_named = "CollectiveTimeoutError" in launch["stderr"] and f"rank(s) [{plan['rank']}]" in launch["stderr"]
    return {
        **plan,
        "exit_code": launch["exit_code"],
        "timed_out": launch["timed_out"],
        "seconds": launch["seconds"],
        "attempts": len(attempts),
        "resumed_at": [max(logs["resume"][a]) for a in attempts],
        "last_step": [logs["last"].get(a, 0) for a in attempts],
        "faults": logs["faults"],
        "newest_valid": newest_valid if len(attempts) > 1 else None,
        "resumed_newest_valid": len(attempts) < 2 or max(logs["resume"][attempts[1]]) == newest_valid,
        "recomputed_steps": recomputed,
        "destroyed_steps": destroyed,
        "lost_steps": max(0, recomputed - destroyed),
        "fresh_starts_with_checkpoints": fresh_with_ckpts,
        "silent_fresh_starts": silent,
        "identical": bool(identical),
        "max_abs_diff": max_abs_diff,
        "hang_named": hang_named,
        "sigcont_sent": launch["sigcont_sent"],
        "sigcont_after_s": launch["sigcont_after_s"],
        "commit_lag_steps": logs["commit_lag"],
        "skipped_warnings": len(re.findall(r"Skipping checkpoint", launch["stderr"])),
        "no_valid_checkpoint_error": "NoValidCheckpointError" in launch["stderr"],
        "not_saved": len(re.findall(r"was not saved", launch["stderr"])),
    }


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
