"""Checkpoints at an epoch boundary, on one process (issue 48).

The last step of an epoch is saved once, at the epoch's end, with the epoch counted as done; a
checkpoint taken after that step but before the epoch's end (a user's own save, or one written
before this rule) resumes at the next epoch's first sample and runs the missed end-of-epoch work
(evaluation, history, callbacks) once, training nothing twice.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.utils.data import TensorDataset

import trainmesh as tm

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_process_group_left_behind")]

torch.manual_seed(0)
X = torch.randn(32, 4)
Y = X.sum(1, keepdim=True)
EVAL = TensorDataset(X[:8], Y[:8])
STEPS_PER_EPOCH = 4  # 32 samples, global batch 8


class Crash(Exception):
    pass


def _trainer(callbacks):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return tm.Trainer(
        model, torch.optim.Adam(model.parameters(), lr=0.01), torch.nn.MSELoss(), callbacks=callbacks, progress=False
    )


def _params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("sharded", [False, True], ids=["model-checkpoint", "sharded-sync"])
def test_an_epochs_last_step_is_saved_once_with_the_epoch_done(tmp_path, sharded):
    saved = []  # (global step, epoch counter, data epoch) of every save, in order
    callback = (
        tm.ShardedCheckpoint(tmp_path, every_n_steps=2, async_save=False)
        if sharded
        else tm.ModelCheckpoint(tmp_path, save_best=False, save_every_n_steps=2)
    )
    trainer = _trainer([callback])
    original = trainer.save_checkpoint if not sharded else None

    def record(*args, **kwargs):
        saved.append((trainer.global_step, trainer.epoch))
        return (original or manager_save)(*args, **kwargs)

    if sharded:
        callback._ensure_manager()
        manager_save = callback.manager.save
        callback.manager.save = record
    else:
        trainer.save_checkpoint = record
    trainer.fit(TensorDataset(X, Y), epochs=2, batch_size=8)
    # Steps 2 and 6 at batch end (epoch counter as is); 4 and 8 once each, at the epoch's end
    # (the counter already moved on), not a second time at batch end.
    assert saved == [(2, 0), (4, 1), (6, 1), (8, 2)], saved


def test_a_save_after_an_epochs_last_step_resumes_at_the_next_epoch(tmp_path):
    """A user's save in on_train_batch_end of the epoch's last step, then a crash before the
    epoch ends: the resume trains none of epoch 1 again, evaluates epoch 1 once, and ends
    bit-identical to an uninterrupted run."""
    reference_trainer = _trainer([])
    reference_trainer.fit(TensorDataset(X, Y), epochs=2, batch_size=8, eval_data=EVAL)
    reference = _params(reference_trainer)

    path = os.path.join(tmp_path, "boundary.pt")

    def save_then_crash(step, logs):
        if crashing.global_step == STEPS_PER_EPOCH:
            crashing.save_checkpoint(path)
            raise Crash

    crashing = _trainer([tm.LambdaCallback(on_train_batch_end=save_then_crash)])
    with pytest.raises(Crash):
        crashing.fit(TensorDataset(X, Y), epochs=2, batch_size=8, eval_data=EVAL)

    trained, evaluated = [], []
    resumed = _trainer([tm.LambdaCallback(on_train_batch_begin=lambda step, logs: trained.append(step))])
    evaluate = resumed.evaluate
    resumed.evaluate = lambda *a, **k: evaluated.append(resumed.epoch) or evaluate(*a, **k)
    with pytest.warns(RuntimeWarning, match="after the last step of epoch 1 and before its end"):
        history = resumed.fit(TensorDataset(X, Y), epochs=2, batch_size=8, eval_data=EVAL, resume=path)
    assert trained == list(range(STEPS_PER_EPOCH))  # epoch 2 only: epoch 1 is not trained again
    assert evaluated == [0, 1]  # epoch 1's missed evaluation once, then epoch 2's
    assert resumed.global_step == 2 * STEPS_PER_EPOCH and resumed.epoch == 2
    assert history.epoch == [0, 1] and len(history.history["val_loss"]) == 2
    assert math.isnan(history.history["loss"][0])  # epoch 1's training loss is not in the checkpoint
    for got, want in zip(_params(resumed), reference):
        assert torch.equal(got, want)
