"""Async checkpoints are committed at the first step boundary where every rank's write is done.

Before, an async save was committed only by the next save, so a crash between saves lost the
newest checkpoint although its bytes were on disk (saves every 3 steps, a kill at step 7 went
back to step 3). Real gloo groups of 2 processes and real DCP writes; one rank's write is held
open where the test needs a slow rank.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _poll_waits_for_the_slowest_rank(directory):
    from concurrent.futures import Future

    import trainmesh as tm
    from trainmesh.checkpoint import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    manager = CheckpointManager(directory, async_save=True)
    assert manager.poll() is None  # nothing in flight: no collective, nothing to commit
    manager.save(3, {"model": model, "trainer": {"step": 3}})
    manager._pending.future.result()  # this rank's real write is on disk
    gate = Future()
    if tm.rank() == 1:  # rank 1 is the slow writer
        manager._pending.future = gate
    held = [manager.poll() for _ in range(3)]
    committed_while_held = manager.checkpoints()
    if tm.rank() == 1:
        gate.set_result(None)
    committed = manager.poll()
    after = manager.checkpoints()
    again = manager.poll()
    manager.close()
    return held, committed_while_held, committed, after, again


def test_poll_commits_once_every_rank_finished_writing():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_poll_waits_for_the_slowest_rank, world_size=2, args=(tmp,), timeout=180)
    for held, committed_while_held, committed, after, again in results:
        assert held == [None, None, None] and committed_while_held == []
        assert committed is not None and os.path.basename(committed) == "step_00000003"
        assert after == [committed] and again is None


def _trainer_commits_between_saves(directory):
    import trainmesh as tm

    seen = {}

    from trainmesh.checkpoint import manager as manager_module

    own_polls = []
    asked_alone = manager_module.all_ranks_finished

    def counting(pending, group):  # poll()'s own all-reduce, used only when nothing else asked
        own_polls.append(pending.step)
        return asked_alone(pending, group)

    manager_module.all_ranks_finished = counting

    class BeforeCheckpoint(tm.Callback):
        """As step 7 begins, waits for this rank's write of step 6, so whether step 7's own
        all-reduce finds every write done does not depend on how fast the disk is."""

        def on_train_batch_begin(self, step, logs=None):
            if self.trainer.global_step == 6:  # steps done so far: step 7 is starting
                pending = ckpt.manager._pending
                assert pending is not None and pending.step == 6
                pending.future.result()
                seen["before"] = [os.path.basename(p) for p in ckpt.manager.checkpoints()]

    class AfterCheckpoint(tm.Callback):
        def on_train_batch_end(self, step, logs=None):
            if self.trainer.global_step == 7:  # where the SIGKILL struck
                seen["after"] = [os.path.basename(p) for p in ckpt.manager.checkpoints()]
                seen["latest"] = os.path.basename(ckpt.manager.latest())  # what a resume would load

    g = torch.Generator().manual_seed(0)
    data = (torch.randn(128, 8, generator=g), torch.randn(128, 2, generator=g))  # 8 steps of 16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ckpt = tm.ShardedCheckpoint(directory, every_n_steps=3, async_save=True, keep_last=5)
    trainer = tm.Trainer(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        torch.nn.MSELoss(),
        callbacks=[BeforeCheckpoint(), ckpt, AfterCheckpoint()],
        progress=False,
    )
    trainer.fit(data, epochs=1, batch_size=16)
    manager_module.all_ranks_finished = asked_alone
    seen["final"] = [os.path.basename(p) for p in ckpt.manager.checkpoints()]
    seen["own_polls"] = own_polls
    return seen


def test_trainer_commits_an_async_save_before_the_next_one_on_the_steps_own_all_reduce():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_trainer_commits_between_saves, world_size=2, args=(tmp,), timeout=240)
    for seen in results:
        assert seen["before"] == ["step_00000003"]  # step 6 written but not yet agreed on
        assert seen["after"] == ["step_00000003", "step_00000006"]
        assert seen["latest"] == "step_00000006"  # a kill here loses 1 step, not 4
        assert seen["final"] == ["step_00000003", "step_00000006", "step_00000008"]
        # The question rode on each step's loss all-reduce: poll() never sent one of its own.
        assert seen["own_polls"] == []
