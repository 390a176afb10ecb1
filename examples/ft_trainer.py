"""One replica group of a fault-tolerant Trainer job: ``tm.Trainer(..., fault_tolerance=tm.ReplicaGroups())``.

Start a Lighthouse, then one of these per replica group; any group may be killed and restarted
(it copies the live Trainer state from a peer and goes on at the shared step):

    trainmesh lighthouse --bind 127.0.0.1:29510 &
    trainmesh run -n 1 --replica-group 0 --lighthouse http://127.0.0.1:29510 examples/ft_trainer.py &
    trainmesh run -n 1 --replica-group 1 --lighthouse http://127.0.0.1:29510 examples/ft_trainer.py

``trainmesh run --replica-group/--lighthouse`` hand the group's number and the Lighthouse's URL to
``tm.ReplicaGroups()`` through the environment. ``--step-log`` writes one JSON line per committed step
(tests read it), ``--save`` the final parameters and counters (tensors and numbers only).
A group may be several processes with any layout inside (``trainmesh run -n 2 --replica-group R ...
examples/ft_trainer.py --zero-stage 2``: ZeRO-2 within the group, gradients averaged across groups
shard by shard). ``--seed S`` gives every group the same initial weights (default: each group its own,
so a group heals on arrival); ``--no-ft`` trains the same job without replica groups (a reference).
``--ckpt-dir DIR --resume``: checkpoints in one directory shared by every group (the quorum's rank-0
group writes each), and a group started with no live peer continues from the newest valid one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

import trainmesh as tm

FEATURES, BATCH = 16, 8


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a ZeRO-sharded DTensor is gathered: every rank of the group calls this)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class StepLog(tm.Callback):
    """A JSON line per committed step; ``--slow-file`` paces the group while that file exists;
    ``--die-file``: once that file exists, this process SIGKILLs itself in the middle of a backward
    (after the step's quorum formed with it, before its gradients reach the all-reduce)."""

    def __init__(self, path: str | None, step_sleep: float, slow_file: str | None, die_file: str | None):
        self.out = open(path, "a") if path and int(os.environ.get("RANK", "0")) == 0 else None
        self.step_sleep, self.slow_file, self.die_file = step_sleep, slow_file, die_file
        self._die_armed = False

    def on_train_batch_begin(self, step, logs=None):
        if self.die_file and os.path.exists(self.die_file):
            # on the model's output, so that it fires under ZeRO too (a hook on a sharded parameter
            # never does: FSDP2's backward runs through the gathered one)
            def die(module, inputs, output):
                output.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))

            if not self._die_armed:
                self._die_armed = True
                self.trainer.unwrapped_model.register_forward_hook(die)

    def on_train_batch_end(self, step, logs=None):
        param_sum = sum(_full(p).double().sum().item() for p in self.trainer.unwrapped_model.parameters())
        if self.out:
            record = {
                "group": int(os.environ.get("TRAINMESH_REPLICA_GROUP", "-1")),
                "step": logs["global_step"],  # committed steps so far, this one included
                **{k: logs.get(k) for k in ("replicas", "healed", "uncommitted_steps", "checkpoint_writer")},
                "time": time.time(),
                "param_sum": param_sum,  # every rank computes it: a ZeRO shard's full tensor is a collective
                "samples": self.trainer._steps.last_indices,  # the step's global batch (the group's share and the others')
            }
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()
        time.sleep(1.0 if self.slow_file and os.path.exists(self.slow_file) else self.step_sleep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=480)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of pretend compute per step")
    parser.add_argument("--slow-file", default=None, help="while this file exists each step takes 1 s")
    parser.add_argument("--die-file", default=None, help="once this file exists, die (SIGKILL) in a backward")
    parser.add_argument("--step-log", default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--ckpt-dir", default=None, help="checkpoints shared by all groups (one group writes each)")
    parser.add_argument("--ckpt-every", type=int, default=10, help="checkpoint interval in committed steps")
    parser.add_argument("--resume", action="store_true", help="fit(resume=True): the newest valid checkpoint")
    parser.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage inside each group (groups of >1 process)")
    parser.add_argument("--seed", type=int, default=None, help="initial weights' seed (default: the group's number)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--no-ft", action="store_true", help="the same job without replica groups (a reference)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, FEATURES, generator=generator)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    seed = args.seed if args.seed is not None else int(os.environ.get("TRAINMESH_REPLICA_GROUP", "0"))
    torch.manual_seed(seed)  # by default unequal on purpose: a group heals
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    callbacks = [StepLog(args.step_log, args.step_sleep, args.slow_file, args.die_file)]
    if args.ckpt_dir:  # synchronous saves: a kill loses at most the interval (async: one step more)
        callbacks.append(tm.ShardedCheckpoint(args.ckpt_dir, every_n_steps=args.ckpt_every, async_save=False))
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if args.optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    groups = None
    if not args.no_ft:
        groups = tm.ReplicaGroups(min_replicas=1, advertise_host="127.0.0.1", timeout_s=10, connect_timeout_s=5)
    trainer = tm.Trainer(
        model,
        optimizer,
        torch.nn.MSELoss(),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9),
        callbacks=callbacks,
        progress=False,
        zero_stage=args.zero_stage,
        fault_tolerance=groups,
    )
    trainer.fit(data, epochs=args.epochs, batch_size=BATCH, resume=args.resume)
    summary = trainer.replica_summary or {}
    print(f"[trainmesh] replica group done: {summary}", flush=True)
    if args.save:
        state = {k: _full(v).clone() for k, v in trainer.unwrapped_model.state_dict().items()}
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save({"model": state, **summary}, args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
