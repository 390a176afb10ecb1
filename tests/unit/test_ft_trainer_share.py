"""trainmesh.ft.trainer_hook's split of a global batch over the replica groups of a step: the rows of
every group together are the batch, once each, and the gradient scale makes the average over the groups
the whole batch's mean gradient, for an uneven split too (no torchft needed: the quorum is given)."""

from __future__ import annotations

import pytest
import torch

from trainmesh.ft.replica_groups import StepInfo
from trainmesh.ft.trainer_hook import TrainerReplicaGroups

pytestmark = pytest.mark.timeout(60)


def _hook(rank: int, groups: int) -> TrainerReplicaGroups:
    hook = TrainerReplicaGroups.__new__(TrainerReplicaGroups)  # the split only: no Trainer, no quorum
    hook.info = StepInfo(step=0, replica_rank=rank, num_replicas=groups, healed=False)
    return hook


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_the_average_of_the_groups_scaled_gradients_is_the_whole_batch_mean(groups):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    micro = [(x[:4], y[:4]), (x[4:], y[4:])]  # two micro-batches, as grad_accum_steps=2 hands them

    def grad(batches, scale=1.0):
        model.zero_grad()
        for bx, by in batches:
            (torch.nn.functional.mse_loss(model(bx), by) / len(batches)).backward()
        return model.weight.grad.clone() * scale

    whole = grad(micro)
    shares, average = [], torch.zeros_like(whole)
    for rank in range(groups):
        hook = _hook(rank, groups)
        mine = hook.share(micro)
        shares.append(torch.cat([bx for bx, _ in mine]))
        average += grad(mine, hook._scale) / groups  # manager.allreduce's average
    assert torch.equal(torch.cat(shares).sort(dim=0).values, x.sort(dim=0).values)  # every row once
    # 8 rows over 3 groups is 2+2+4 per step (1+1+2 per micro-batch): the scale makes the average exact
    torch.testing.assert_close(average, whole, rtol=1e-6, atol=1e-7)
