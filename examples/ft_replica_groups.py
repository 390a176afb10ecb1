"""One replica group of a fault-tolerant job: a small MLP, averaged with the other live groups each step.

Start a Lighthouse, then one of these per replica group (any group may be killed and restarted;
a restarted group copies the live state from a peer and goes on at the shared step):

    trainmesh lighthouse --bind 127.0.0.1:29510 &
    python examples/ft_replica_groups.py --replica-group 0 --lighthouse http://127.0.0.1:29510 &
    python examples/ft_replica_groups.py --replica-group 1 --lighthouse http://127.0.0.1:29510

Step s's batch is the same 8 rows on every group (seeded by s); the groups in that step's quorum
split it, so the committed update is the whole batch's mean gradient whatever the number of groups.
``--log`` writes one JSON line per step (tests read it); ``--save`` the final parameters (tensors only).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from trainmesh.ft import ReplicaGroups, ReplicaGroupSync

BATCH, FEATURES = 8, 16


def batch_for(step: int, replica_rank: int, num_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    rows = slice(replica_rank * BATCH // num_replicas, (replica_rank + 1) * BATCH // num_replicas)
    return x[rows], y[rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-group", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of pretend compute per step")
    parser.add_argument(
        "--slow-file", default=None, help="while this file exists, each step takes 1 s (tests pace a group with it)"
    )
    parser.add_argument("--timeout-s", type=float, default=10.0, help="how long a collective waits for a peer")
    parser.add_argument("--log", default=None)
    parser.add_argument("--save", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # A different seed per group on purpose: the groups start equal only because the second one
    # copies the first one's state at step 0 (torchft's init_sync), over trainmesh's transport.
    torch.manual_seed(args.replica_group)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    sync = ReplicaGroupSync(
        model,
        optimizer,
        ReplicaGroups(
            replica_group=args.replica_group,
            lighthouse=args.lighthouse,
            min_replicas=args.min_replicas,
            timeout_s=args.timeout_s,
            quorum_timeout_s=30,
        ),
        scheduler=scheduler,
    )
    log = open(args.log, "a") if args.log else None
    try:
        while sync.current_step < args.steps:
            info = sync.begin_step()
            x, y = batch_for(info.step, info.replica_rank, info.num_replicas)
            # the mean over this group's rows, scaled so the all-reduce's average is the whole batch's mean
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss * (x.shape[0] * info.num_replicas / BATCH)).backward()
            time.sleep(1.0 if args.slow_file and os.path.exists(args.slow_file) else args.step_sleep)
            committed = sync.finish_step()
            record = {
                "step": info.step,
                "committed": committed,
                "replicas": info.num_replicas,
                "healed": info.healed,
                "left": list(info.left),
                "loss": loss.item(),
                "time": time.time(),
                "param_sum": sum(p.double().sum().item() for p in model.parameters()),
            }
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
            if info.step % 5 == 0 or not committed:
                print(f"[group {args.replica_group}] {record}", flush=True)
        if args.save:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.save)
        print(
            f"[group {args.replica_group}] done: step {sync.current_step}, batches committed "
            f"{sync.batches_committed}, uncommitted steps {sync.uncommitted_steps}",
            flush=True,
        )
    finally:
        sync.shutdown()
        if log:
            log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
