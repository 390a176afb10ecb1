"""A small, deterministic training job for the fault-tolerance tests (run through `trainmesh run`).

It checkpoints every 2 steps, auto-resumes from the last checkpoint, logs which samples each
process trained on at every step, and (with --kill-at) SIGKILLs rank 1 at that global step
in the first attempt of the launch.
"""

import argparse
import os
import signal

import torch

import trainmesh as tm
from trainmesh.testing.sample_log import SampleLog

N, GLOBAL_BATCH = 96, 16  # 6 steps per epoch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint", choices=["full", "sharded"], default="full")
    # The kill runs in the sample log's on_train_batch_end; first in the list, it comes before the
    # checkpoint callback of the same step can poll (commit) an async save in flight.
    parser.add_argument("--kill-before-checkpoint", action="store_true")
    args = parser.parse_args()
    tm.initialize()
    torch.set_num_threads(1)
    rank, restart = tm.rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    attempt = f"{args.tag}-{restart}"
    log_path = os.path.join(args.out, f"samples.rank{rank}.log")

    g = torch.Generator().manual_seed(0)
    data = (torch.randn(N, 8, generator=g), torch.randn(N, 2, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def kill_rank1(global_step: int) -> None:
        if args.kill_at and restart == 0 and rank == 1 and global_step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    if args.checkpoint == "sharded":  # DCP shards, async, sealed with a checksummed marker
        checkpoint = tm.ShardedCheckpoint(os.path.join(args.out, "ckpt"), every_n_steps=2, async_save=True)
    else:  # one full state file, written atomically by the main process
        checkpoint = tm.ModelCheckpoint(os.path.join(args.out, "ckpt"), save_best=False, save_every_n_steps=2)
    callbacks = [checkpoint, SampleLog(log_path, attempt, after_step=kill_rank1)]
    if args.kill_before_checkpoint:
        callbacks.reverse()
    trainer = tm.Trainer(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), torch.nn.MSELoss(), callbacks=callbacks, progress=False
    )
    trainer.fit(data, epochs=args.epochs, batch_size=GLOBAL_BATCH, resume=True)
    final = trainer.state_dict()["model"]
    if tm.is_main_process():
        torch.save(final, os.path.join(args.out, "final.pt"))
    tm.shutdown()


if __name__ == "__main__":
    main()
