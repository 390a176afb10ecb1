"""The gradient norm riding on the step's loss-check all-reduce (one process: the all-reduce is the
identity, so what comes back must be exactly what went in, each value in its own slot)."""

from __future__ import annotations

import math

import pytest
import torch

from trainmesh.trainer import loss_tracking
from trainmesh.trainer.loss_tracking import LossAccumulator
from trainmesh.trainer.step import global_grad_norm, local_grad_square_sum

pytestmark = pytest.mark.timeout(60)


class Rider:
    def __init__(self, value: float):
        self.value, self.received = value, None

    def local_value(self) -> float:
        return self.value

    def receive(self, total: float) -> None:
        self.received = total


def test_grad_norm_rides_beside_the_riders_and_matches_torch(monkeypatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model(torch.randn(5, 8)).pow(2).sum().backward()
    params = list(model.parameters())
    square = local_grad_square_sum(params)
    assert square.dtype == torch.float64 and square.dim() == 0
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0))
    assert math.isclose(global_grad_norm(params), expected, rel_tol=1e-6)

    rider = Rider(7.0)
    monkeypatch.setattr(loss_tracking, "_RIDERS", [rider])
    losses = LossAccumulator()
    losses.add(torch.tensor(2.5), 4)
    assert losses.end_step(check=True, stop_local=False, grad_square=square) == (False, False)
    assert rider.received == 7.0  # its own slot, not the gradient's
    assert math.isclose(losses.grad_norm, expected, rel_tol=1e-6)
    assert losses.sync(False)[:2] == (2.5, 4.0)  # the loss accounting is untouched
    losses.add(torch.tensor(1.0), 2)
    losses.end_step(check=True, stop_local=False)  # no gradients along: no norm, rider still served
    assert losses.grad_norm is None and rider.received == 7.0
