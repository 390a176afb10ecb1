"""The seed's custom loop (strategy.run + strategy.reduce) and the Trainer reach the same weights.

Both consume the same shuffled global batches (the example's seeded DataLoader), on 2 real
processes, fp32; tolerance 1e-6 absolute on the weights (they are O(0.1)).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from trainmesh.testing import run_distributed

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples")))

import strategy_custom_loop as loop  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _both() -> dict:
    import trainmesh as tm

    strategy = tm.MirroredStrategy()
    custom = loop.train(strategy, epochs=2)

    with strategy.scope():
        model = loop.make_model(0)
        optimizer = loop.make_optimizer(model.parameters())
    global_batch = loop.PER_REPLICA_BATCH_SIZE * strategy.num_replicas_in_sync
    trainer = tm.Trainer(model, optimizer, torch.nn.CrossEntropyLoss(), distribution=strategy, progress=False)
    trainer.fit(loop.make_loader(loop.make_data(), global_batch, shuffle=True, seed=0), epochs=2)
    trained = {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}
    return {
        "custom": custom["weights"],
        "trainer": trained,
        "replicas": strategy.num_replicas_in_sync,
        "moved": max(
            (custom["weights"][k] - loop.make_model(0).state_dict()[k]).abs().max().item() for k in custom["weights"]
        ),
    }


def test_custom_loop_equals_trainer_on_two_processes():
    results = run_distributed(_both, world_size=2, timeout=240)
    for result in results:
        assert result["replicas"] == 2
        assert result["moved"] > 1e-3  # training really changed the weights
        assert result["custom"].keys() == result["trainer"].keys()
        for name, value in result["custom"].items():
            torch.testing.assert_close(result["trainer"][name], value, rtol=0, atol=1e-6, msg=name)
