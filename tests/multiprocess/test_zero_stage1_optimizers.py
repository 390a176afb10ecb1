"""ZeRO stage 1 keeps the user's optimizer (class and hyper-parameters, AdamW's decoupled weight decay
included) over the FSDP2 parameter shards, so its state is sharded, and trains like stage 0."""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _train(zero_stage: int) -> dict:
    import trainmesh as tm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g))
    trainer = tm.Trainer(model, optimizer, torch.nn.MSELoss(), zero_stage=zero_stage, progress=False)
    trainer.fit(data, epochs=2, batch_size=16)
    group = trainer.optimizer.param_groups[0]
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return {
        "type": type(trainer.optimizer).__name__,
        "weight_decay": group["weight_decay"],
        "same_object": trainer.optimizer is optimizer,
        "state_sharded": bool(state) and all(hasattr(v, "placements") for v in state),
        "params": {k: v.clone() for k, v in trainer.state_dict()["model"].items()},
    }


def _both() -> dict:
    return {0: _train(0), 1: _train(1)}


def test_adamw_under_zero_stage_1_equals_stage_0():
    results = run_distributed(_both, world_size=2, timeout=150)
    for result in results:
        assert result[1]["type"] == "AdamW" and result[1]["weight_decay"] == 0.1 and result[1]["same_object"]
        assert result[1]["state_sharded"] and not result[0]["state_sharded"]
    for name, value in results[0][0]["params"].items():
        torch.testing.assert_close(results[0][1]["params"][name], value, rtol=1e-5, atol=1e-6)
