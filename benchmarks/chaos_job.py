"""chaos.py's job, one rank of it (``chaos.py --worker``, under ``trainmesh run``): the MLP under ZeRO-2
trained with asynchronous sharded checkpoints and ``fit(resume=True)``, a log of every resume, step and
commit, and the fault the plan names injected from inside (a corrupted checkpoint, a full disk, a kill
in a save). The job's shape (steps, interval, batch) is defined here, and the driver reads it.

It exists apart from the script because it runs inside the faulted processes, the script outside them.
"""

from __future__ import annotations

import argparse
import os
import random
import signal


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
