"""The Trainer's per-step loss check starts before the last backward and runs beside it (CPU).

Checked here: (1) the check is launched after every micro-batch's loss is in and before any
gradient exists; (2) on two processes, launching it early gives exactly the numbers of the
check after backward (losses, a non-finite loss on one process only, a stop request, riders);
(3) a check in flight cannot be started twice or ended without being checked.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainmesh.testing import run_distributed
from trainmesh.trainer import loss_tracking
from trainmesh.trainer.loss_tracking import LossAccumulator
from trainmesh.trainer.precision import build_precision
from trainmesh.trainer.step import forward_backward

pytestmark = pytest.mark.timeout(120)


def test_the_check_starts_after_every_loss_and_before_the_last_backward() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    micro = [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(2)]
    losses, seen = LossAccumulator(), []

    def launch():
        seen.append((losses._step_samples, [p.grad is None for p in model.parameters()]))
        losses.start_check(stop_local=False)

    # Two micro-batches: the first one's backward has run (grads exist) when the last loss comes in;
    # what must hold is that the launch sees both losses and precedes the last backward.
    first_grads = {}

    def on_weight_grad(grad):  # which backward (0, 1) ran after how many launches
        first_grads[len(first_grads)] = len(seen)

    model.weight.register_hook(on_weight_grad)
    forward_backward(
        model, micro, torch.nn.functional.mse_loss, build_precision("fp32", "cpu"), losses, before_last_backward=launch
    )
    assert [s[0] for s in seen] == [6]  # once, with both micro-batches' 3 rows each
    assert first_grads == {0: 0, 1: 1}  # first backward before the launch, the last one after it
    with torch.no_grad():  # weights unchanged: no optimizer step ran
        expected = sum(float(torch.nn.functional.mse_loss(model(x), y)) for x, y in micro)
    assert losses.end_step(check=True, stop_local=False) == (False, False)
    mean, samples, _ = losses.sync(False)
    assert samples == 6 and math.isclose(mean, expected / 2, rel_tol=1e-6)


def test_a_check_in_flight_is_ended_once() -> None:
    losses = LossAccumulator()
    losses.add(torch.tensor(1.0), 2)
    losses.start_check(stop_local=False)
    with pytest.raises(RuntimeError, match="twice"):
        losses.start_check(stop_local=False)
    with pytest.raises(RuntimeError, match="checked end_step"):
        losses.end_step(check=True, stop_local=False, grad_square=torch.tensor(1.0, dtype=torch.float64))


class _Rider:
    def __init__(self, value):
        self.value, self.received = value, None

    def local_value(self):
        return self.value

    def receive(self, total):
        self.received = total


def _early_and_late_agree() -> list:
    rank = torch.distributed.get_rank()
    rider = _Rider(float(rank + 1))
    loss_tracking.add_rider(rider)
    steps = [  # (loss on this rank, rows, stop request here)
        (torch.tensor(1.5 + rank, dtype=torch.float32), 4, False),
        (torch.tensor(math.inf if rank == 1 else 2.0), 4, False),  # non-finite on one process only
        (torch.tensor(0.25 * (rank + 1)), 3 + rank, rank == 0),
    ]
    results = {}
    for mode in ("late", "early"):
        losses, out = LossAccumulator(), []
        for loss, rows, stop in steps:
            losses.add(loss, rows)
            if mode == "early":
                losses.start_check(stop_local=stop)
            out.append((losses.end_step(check=True, stop_local=stop), rider.received))
        out.append(losses.sync(False))
        results[mode] = out
    loss_tracking.remove_rider(rider)
    return results


def test_early_check_gives_the_numbers_of_the_late_one_on_two_processes() -> None:
    for result in run_distributed(_early_and_late_agree, world_size=2):
        assert result["early"] == result["late"]
        flags = [step[0] for step in result["early"][:3]]
        assert flags == [(False, False), (True, False), (False, True)]
        assert result["early"][0][1] == 3.0  # riders summed: 1 + 2
        mean, samples, _ = result["early"][3]
        # step 2 is dropped everywhere; steps 1 and 3 count: (1.5*4 + 2.5*4 + 0.25*3 + 0.5*4) / 15
        assert samples == 15.0 and math.isclose(mean, (6.0 + 10.0 + 0.75 + 2.0) / 15, rel_tol=1e-12)
