"""A NaN loss on ONE process: every process takes the same decision (skip / stop / rollback).

The NaN is injected on rank 1 only, at a chosen global step, through the loss function.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

N, BATCH = 64, 16  # 4 steps per epoch


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 6, generator=g), torch.randn(N, 2, generator=g)


def _run(policy: str, bad_step: int, epochs: int, checkpoint_dir: str | None = None) -> dict:
    import trainmesh as tm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    holder = {}

    def loss_fn(out, target):
        loss = torch.nn.functional.mse_loss(out, target)
        if tm.rank() == 1 and holder["trainer"].global_step == bad_step:
            return loss * float("nan")
        return loss

    callbacks = [tm.ModelCheckpoint(checkpoint_dir, save_best=False)] if checkpoint_dir else []
    trainer = tm.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn,
        nonfinite_loss=policy,
        callbacks=callbacks,
        progress=False,
    )
    holder["trainer"] = trainer
    weights_after = {}

    class Capture(tm.Callback):
        def on_train_batch_end(self, step, logs=None):
            weights = [p.detach().clone() for p in trainer.unwrapped_model.parameters()]
            if logs.get("nonfinite"):
                weights_after["w"] = weights
                if checkpoint_dir:  # what the rollback should have restored: the file as it is now
                    state = torch.load(os.path.join(checkpoint_dir, "last.pt"), map_location="cpu", weights_only=False)
                    weights_after["checkpoint"] = [v.clone() for v in state["model"].values()]
            elif "w" not in weights_after:
                weights_after["before"] = weights  # the last good step's weights (before the bad one)

    trainer.callbacks.append(Capture())
    history = trainer.fit(_data(), epochs=epochs, batch_size=BATCH, shuffle=False)
    return {
        "skipped": [s.get("nonfinite", False) for s in history.steps],
        "losses": [s["loss"] for s in history.steps],
        "global_step": trainer.global_step,
        "params": [p.detach().clone() for p in trainer.unwrapped_model.parameters()],
        "rollbacks": trainer.rollbacks,
        "after_bad_step": weights_after.get("w"),
        "before_bad_step": weights_after.get("before"),
        "checkpoint_at_bad_step": weights_after.get("checkpoint"),
        "epoch_losses": history.history["loss"],
    }


def _scenarios(tmp: str) -> dict:
    return {
        "skip": _run("skip", bad_step=2, epochs=1),
        "stop": _run("stop", bad_step=1, epochs=2),
        # Epoch 1 saves last.pt; the NaN comes at the third step of epoch 2 (global step 6), after two
        # good steps have moved the weights away from the checkpoint's (so skip != rollback).
        "rollback": _run("rollback", bad_step=6, epochs=2, checkpoint_dir=os.path.join(tmp, "ckpt")),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_scenarios, world_size=2, args=(str(tmp_path_factory.mktemp("guard")),), timeout=200)


def test_skip_drops_the_step_everywhere(results):
    for result in results:
        skip = result["skip"]
        assert skip["skipped"] == [False, False, True, False]
        # The skipped step reports no loss (nan); the others and the epoch's loss are finite.
        assert [math.isfinite(v) for v in skip["losses"]] == [True, True, False, True]
        assert math.isfinite(skip["epoch_losses"][0])
        assert all(torch.isfinite(p).all() for p in skip["params"])
    for a, b in zip(results[0]["skip"]["params"], results[1]["skip"]["params"]):
        assert torch.equal(a, b)  # replicas identical after the skipped step


def test_stop_ends_training_on_every_process_at_the_same_step(results):
    assert [r["stop"]["global_step"] for r in results] == [2, 2]
    assert [r["stop"]["skipped"] for r in results] == [[False, True]] * 2


def test_rollback_restores_the_last_checkpoint(results):
    for result in results:
        rollback = result["rollback"]
        assert rollback["rollbacks"] == 1 and rollback["skipped"] == [False] * 6 + [True, False]
        # Right after the bad step, the weights are exactly the checkpoint's (saved at the end of
        # epoch 1), not the weights the two good steps of epoch 2 had reached.
        restored, saved = rollback["after_bad_step"], rollback["checkpoint_at_bad_step"]
        assert restored is not None and saved is not None and len(restored) == len(saved) == 4
        for a, b in zip(restored, saved):
            assert torch.equal(a, b)
        moved = max((a - b).abs().max().item() for a, b in zip(rollback["before_bad_step"], saved))
        assert moved > 1e-4, "the good steps of epoch 2 did not move the weights: the check would be vacuous"
        assert all(torch.isfinite(p).all() for p in rollback["params"])
    for a, b in zip(results[0]["rollback"]["after_bad_step"], results[1]["rollback"]["after_bad_step"]):
        assert torch.equal(a, b)
