"""Practice exercise 1 of the TF guide: a small CNN on CIFAR-10 with MirroredStrategy, and
the step time of one process versus N processes.

    trainmesh run -n 2 examples/cifar_cnn_mirrored.py --steps 20
    trainmesh run -n 2 examples/cifar_cnn_mirrored.py --steps 20 --no-compare

The data is random, CIFAR-10-shaped (3x32x32 images, 10 classes), generated with a fixed
seed (no download): this measures speed, not accuracy.

What is compared, as in the exercise "one GPU versus several" (same model, same global
batch of ``--per-replica-batch`` x N images, a "device" being one process's share):

* "1 device": before the distributed run, process 0 trains alone on the whole global batch
  with plain torch while the others wait (blocked in a barrier, using no CPU), with the
  threads one replica has (``--baseline-threads`` to give it more, e.g. the whole machine);
* "N devices": the MirroredStrategy custom loop, each replica on its slice of the batch,
  gradients summed over replicas at every ``optimizer.step()``.

Both report the median step time after ``--warmup`` steps. For a fully separate baseline,
run ``trainmesh run -n 1 examples/cifar_cnn_mirrored.py --no-compare --per-replica-batch B``
with B the global batch. Timings on a shared machine are noisy; on N GPUs each replica has
its own device.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from torch import nn

import trainmesh as tm
from trainmesh.strategy import MirroredStrategy, ReduceOp, compute_average_loss


def make_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 32x16x16
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 64x8x8
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def make_batches(steps: int, global_batch_size: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of random images and labels, identical on every process."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(global_batch_size, 3, 32, 32, generator=generator),
            torch.randint(0, 10, (global_batch_size,), generator=generator),
        )
        for _ in range(steps)
    ]


def timed_steps(step: Callable[[tuple], float], batches) -> tuple[list[float], list[float]]:
    """Run ``step`` on every batch; return (losses, step wall times in seconds)."""
    losses, times = [], []
    for batch in batches:
        start = time.perf_counter()
        losses.append(step(batch))
        times.append(time.perf_counter() - start)
    return losses, times


def single_process_times(batches, threads: int) -> list[float]:
    """Plain torch on this process alone: the one-device baseline."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = make_cnn()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(batch) -> float:
            x, y = batch
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss.item()

        return timed_steps(step, batches)[1]
    finally:
        torch.set_num_threads(previous)


def mirrored_times(strategy: MirroredStrategy, batches, global_batch_size: int) -> tuple[list[float], list[float]]:
    with strategy.scope():
        model = make_cnn()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_object = nn.CrossEntropyLoss(reduction="none")

    def train_step(inputs):
        x, y = inputs
        loss = compute_average_loss(loss_object(model(x), y), global_batch_size=global_batch_size)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    def distributed_train_step(inputs) -> float:
        return float(strategy.reduce(ReduceOp.SUM, strategy.run(train_step, args=(inputs,))))

    return timed_steps(distributed_train_step, strategy.experimental_distribute_dataset(batches))


def main() -> None:
    parser = argparse.ArgumentParser(description="Small CNN on CIFAR-10-shaped data with MirroredStrategy.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--per-replica-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument(
        "--compare", action=argparse.BooleanOptionalAction, default=True, help="time one process first (default: on)"
    )
    parser.add_argument(
        "--baseline-threads",
        type=int,
        default=None,
        help="threads of the one-process baseline (default: as many as one replica)",
    )
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps must exceed --warmup. Received: --steps {args.steps}, --warmup {args.warmup}")

    tm.initialize()
    strategy = MirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    global_batch_size = args.per_replica_batch * replicas
    batches = make_batches(args.steps, global_batch_size)
    say = print if tm.is_main_process() else (lambda _line: None)
    say(f"CNN on CIFAR-10-shaped data: {replicas} replicas, global batch {global_batch_size}, {args.steps} steps")

    rows = []
    if args.compare:
        if tm.is_main_process():
            threads = args.baseline_threads or torch.get_num_threads()
            rows.append((f"1 device ({threads} threads)", single_process_times(batches, threads)))
        tm.barrier()  # the others wait, so process 0 has the machine to itself
    losses, times = mirrored_times(strategy, batches, global_batch_size)
    rows.append((f"{replicas} devices ({torch.get_num_threads()} threads each)", times))

    say(f"loss: first step {losses[0]:.4f}, last step {losses[-1]:.4f}")
    medians = []
    for label, step_times in rows:
        median = statistics.median(step_times[args.warmup :])
        medians.append(median)
        say(f"{label:<32} {median * 1e3:8.1f} ms/step  {global_batch_size / median:9.1f} samples/s")
    if len(medians) == 2:
        say(f"speed-up: {medians[0] / medians[1]:.2f}x with {replicas} devices")
    strategy.close()
    tm.shutdown()


if __name__ == "__main__":
    main()
