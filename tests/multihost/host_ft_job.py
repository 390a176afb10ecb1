"""A deterministic training job for the host-failure tests and benchmark (run through `trainmesh run`).

It checkpoints every ``--every`` steps (sharded, async: committed at the first step boundary
where every rank's write is done), auto-resumes from the last checkpoint, and logs which samples
each process trained on at every step. With ``--stall-at K`` (given only to the launcher of the
host that is to be lost) its processes stop after step K and wait to be killed, or cut off, by
the test; the other host's processes go on into step K+1 and find their peers gone.

Every attempt (one rendezvous round) has one name on all ranks: rank 0's ``TAG-RESTART``,
broadcast, so the log of a relaunched host lines up with the survivors' restart.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import trainmesh as tm
from trainmesh.testing.sample_log import SampleLog

N, GLOBAL_BATCH = 96, 16  # 6 steps per epoch on any world size dividing 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--stall-at", type=int, default=0)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="seconds per step, so an async write ends before the next boundary as it would with real steps",
    )
    args = parser.parse_args()
    cluster = tm.initialize()
    torch.set_num_threads(1)
    rank = cluster.rank
    box = [f"{args.tag}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"]
    dist.broadcast_object_list(box, src=0)
    attempt = box[0]
    log_path = os.path.join(args.out, f"samples.rank{rank}.log")

    g = torch.Generator().manual_seed(0)
    data = (torch.randn(N, 8, generator=g), torch.randn(N, 2, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))

    def stall(global_step: int) -> None:
        if args.stall_at and global_step == args.stall_at:
            with open(os.path.join(args.out, f"stalled.rank{rank}"), "w") as fh:
                fh.write(attempt)
            time.sleep(600)  # until the test kills this host or cuts it off

    sample_log = SampleLog(
        log_path,
        attempt,
        resume_extra=str(cluster.world_size),
        before_step=(lambda: time.sleep(args.step_sleep)) if args.step_sleep else None,
        after_step=stall,
    )
    checkpoint = tm.ShardedCheckpoint(os.path.join(args.out, "ckpt"), every_n_steps=args.every, async_save=True)
    trainer = tm.Trainer(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        torch.nn.MSELoss(),
        callbacks=[checkpoint, sample_log],
        progress=False,
    )
    try:
        trainer.fit(data, epochs=args.epochs, batch_size=GLOBAL_BATCH, resume=True)
    except Exception as error:  # the survivors' diagnosis is part of what the tests check
        with open(os.path.join(args.out, f"error.{attempt}.rank{rank}.json"), "w") as fh:
            json.dump(
                {"type": type(error).__name__, "error": str(error), "missing": getattr(error, "missing_ranks", None)},
                fh,
            )
        raise
    final = trainer.state_dict()["model"]
    if tm.is_main_process():
        torch.save(final, os.path.join(args.out, "final.pt"))
    tm.shutdown()


if __name__ == "__main__":
    main()
