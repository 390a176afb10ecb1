"""The TF guide's custom training loop with MirroredStrategy, on PyTorch (trainmesh.strategy).

    trainmesh run -n 2 examples/strategy_custom_loop.py [--epochs 3]
    python examples/strategy_custom_loop.py                 # one replica: the same loop

TensorFlow, from the guide:                      Here:
    with strategy.scope(): model = ...           with strategy.scope(): model = make_model()
    loss_object(y, predictions) (reduction NONE) loss_object(logits, y), reduction="none"
    tf.nn.compute_average_loss(.., GLOBAL_BS)    compute_average_loss(.., global_batch_size)
    tape.gradient + optimizer.apply_gradients    loss.backward() + optimizer.step()  (SUM over replicas)
    strategy.run / strategy.reduce(SUM, ..)      the same

The model, data and optimizer are built by functions (``make_model``, ``make_data``,
``make_optimizer``, ``make_loader``) so a test can train the same thing another way (one
process, or the Trainer) and compare weights; ``train()`` returns the final weights.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainmesh as tm
from trainmesh.strategy import MirroredStrategy, ReduceOp, compute_average_loss

NUM_FEATURES = 32
NUM_CLASSES = 10
NUM_SAMPLES = 1024  # divisible by 64 x {1, 2, 4} replicas: every global batch is full
PER_REPLICA_BATCH_SIZE = 64  # the guide's "batch_size = 64 * strategy.num_replicas_in_sync"
LEARNING_RATE = 1e-3


def make_data(num_samples: int = NUM_SAMPLES, seed: int = 0) -> TensorDataset:
    """Synthetic classification data with a learnable rule, identical on every process."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, NUM_FEATURES, generator=generator)
    teacher = torch.randn(NUM_FEATURES, NUM_CLASSES, generator=generator)
    noise = 0.5 * torch.randn(num_samples, NUM_CLASSES, generator=generator)
    return TensorDataset(x, (x @ teacher + noise).argmax(dim=1))


def make_model(seed: int = 0) -> nn.Module:
    """The guide's model: Dense(128, relu) then Dense(10) (logits)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(NUM_FEATURES, 128), nn.ReLU(), nn.Linear(128, NUM_CLASSES))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LEARNING_RATE)  # the guide compiles with 'adam'


def make_loader(dataset: TensorDataset, global_batch_size: int, *, shuffle: bool = True, seed: int = 0) -> DataLoader:
    """Global batches (``dataset.shuffle(..).batch(global)``); the seeded generator gives every
    process the same order, which experimental_distribute_dataset requires."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=global_batch_size, shuffle=shuffle, generator=generator)


def train(
    strategy: MirroredStrategy | None = None,
    *,
    epochs: int = 3,
    global_batch_size: int | None = None,
    num_samples: int = NUM_SAMPLES,
    shuffle: bool = True,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Train with the guide's custom loop; returns ``{"weights", "losses", "global_batch_size"}``.

    ``weights`` is the final ``state_dict`` (identical on every replica); ``losses`` the mean
    training loss of each epoch. ``global_batch_size`` defaults to 64 per replica.
    """
    strategy = strategy or MirroredStrategy()
    global_batch_size = global_batch_size or PER_REPLICA_BATCH_SIZE * strategy.num_replicas_in_sync

    with strategy.scope():
        model = make_model(seed)
        optimizer = make_optimizer(model.parameters())
        loss_object = nn.CrossEntropyLoss(reduction="none")  # per-example loss, as reduction=NONE

    dataset = make_loader(make_data(num_samples, seed), global_batch_size, shuffle=shuffle, seed=seed)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def train_step(inputs):
        x, y = inputs
        per_example_loss = loss_object(model(x), y)
        loss = compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # mirrored parameters: gradients are SUMmed over replicas first
        return loss.detach()

    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(ReduceOp.SUM, per_replica_losses, axis=None)

    losses = []
    for epoch in range(epochs):
        total_loss, num_batches = 0.0, 0
        for batch in dist_dataset:
            total_loss += float(distributed_train_step(batch))
            num_batches += 1
        losses.append(total_loss / num_batches)
        if log is not None:
            log(f"Epoch {epoch + 1}, Loss: {losses[-1]:.4f}")
    weights = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    return {"weights": weights, "losses": losses, "global_batch_size": global_batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    tm.initialize()
    strategy = MirroredStrategy()
    say = print if tm.is_main_process() else (lambda _line: None)
    say(f"Number of devices: {strategy.num_replicas_in_sync}")
    train(strategy, epochs=args.epochs, log=say)
    strategy.close()
    tm.shutdown()


if __name__ == "__main__":
    main()
