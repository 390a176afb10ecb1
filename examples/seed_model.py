"""The model, data and training loop of the Keras distribution guide, written for PyTorch.

Shared by ``keras_data_parallel.py`` and ``keras_model_parallel.py``: the two programs
differ only in the distribution they declare, which is the point of the guide.

Keras -> PyTorch: ``Dense(200, use_bias=False, activation="relu", name="d1")`` is
``d1 = Linear(784, 200, bias=False)`` + ReLU; ``compile(loss="mse")`` trains with
Keras' default optimizer, RMSprop(lr=1e-3, rho=0.9, epsilon=1e-7).
"""

from __future__ import annotations

import torch
from torch import nn

import trainmesh as tm

NUM_SAMPLES = 128
GLOBAL_BATCH_SIZE = 16
EPOCHS = 3


class SeedModel(nn.Module):
    def __init__(self, dropout: float = 0.4):
        super().__init__()
        self.flatten = nn.Flatten()
        self.d1 = nn.Linear(784, 200, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.d2 = nn.Linear(200, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.d1(self.flatten(x)))
        y = self.dropout(y)
        return torch.softmax(self.d2(y), dim=-1)


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """128 random 28x28x1 "images" and 10-dim targets, as in the guide (same on every process)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(NUM_SAMPLES, 28, 28, 1, generator=generator)
    labels = torch.randn(NUM_SAMPLES, 10, generator=generator)
    return inputs, labels


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, eps=1e-7)


def fit_and_evaluate(
    distribution: tm.Distribution, *, epochs: int = EPOCHS, dropout: float = 0.4, seed: int = 0, verbose: bool = True
) -> dict:
    """Train as the guide does, under ``distribution``; return per-step losses and the evaluation."""
    torch.manual_seed(seed)
    model = SeedModel(dropout)
    data = make_data(seed)
    with distribution.scope():
        model = distribution.distribute_model(model)
        train_batches = distribution.distribute_dataset(data, GLOBAL_BATCH_SIZE, shuffle=True, seed=seed)
        eval_batches = distribution.distribute_dataset(data, GLOBAL_BATCH_SIZE)
    optimizer = build_optimizer(model)
    loss_fn = nn.MSELoss()
    step_losses, epoch_losses = [], []
    for epoch in range(epochs):
        model.train()
        losses = []
        for inputs, labels in train_batches:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), labels)
            loss.backward()
            optimizer.step()
            losses.append(distribution.global_mean(loss))
        step_losses.extend(losses)
        epoch_losses.append(sum(losses) / len(losses))
        if verbose and tm.is_main_process():
            print(
                f"Epoch {epoch + 1}/{epochs}  {len(losses)}/{len(train_batches)} steps - loss: {epoch_losses[-1]:.4f}"
            )
    model.eval()
    with torch.no_grad():
        eval_losses = [distribution.global_mean(loss_fn(model(x), y)) for x, y in eval_batches]
    evaluation = sum(eval_losses) / len(eval_losses)
    if verbose and tm.is_main_process():
        print(f"Evaluation - loss: {evaluation:.4f}")
    return {"step_losses": step_losses, "epoch_losses": epoch_losses, "eval_loss": evaluation, "model": model}
