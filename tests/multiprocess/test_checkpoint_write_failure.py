"""A checkpoint write that fails on one rank (a real one: the process's file size limit,
RLIMIT_FSIZE, so the kernel refuses the bytes with EFBIG, as a full disk refuses them with
ENOSPC) is agreed on by every rank: it is reported with the path, each failed rank's error and
the free space; nothing is committed, the previous checkpoint is kept (retention does not prune
it, even with keep_last=1), and training goes on to save again once the disk takes bytes.
Both paths: the asynchronous DCP write failing in its background thread (agreed on at the next
step boundary) and a small synchronous file failing before DCP starts (agreed on at once).
"""

from __future__ import annotations

import os
import resource
import signal
import tempfile

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

LIMIT = 64 << 10  # bytes: rank 1's per-rank extras fit, its DCP shard (~200 KB of Adam state) does not


def _limit_file_size(limit: int | None) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if limit is None else limit, hard))


def _train_through_a_failed_save(directory):
    try:
        return _train(directory)
    finally:
        _limit_file_size(None)  # whatever happened, the harness writes this rank's result


def _train(directory):
    import warnings

    import trainmesh as tm
    from trainmesh.checkpoint import CheckpointManager

    rank = tm.rank()
    # Without this the kernel's SIGXFSZ kills the process instead of failing the write.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    seen = {}

    class DiskTrouble(tm.Callback):  # after the checkpoint's callback: step s's save has started
        def on_train_batch_end(self, step, logs=None):
            s = self.trainer.global_step
            if s == 3 and rank == 1:
                _limit_file_size(LIMIT)  # the step-4 save fails on rank 1 only
            if s == 5:  # its failure has been agreed on by now (the step after the save)
                seen["failures"] = list(ckpt.manager.failures)
                seen["at_failure"] = [os.path.basename(p) for p in ckpt.manager.checkpoints()]
                seen["leftovers"] = sorted(os.listdir(directory))
                if rank == 1:
                    _limit_file_size(None)  # space freed: the next saves succeed

    g = torch.Generator().manual_seed(0)
    data = (torch.randn(128, 128, generator=g), torch.randn(128, 64, generator=g))  # 8 steps of 16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
    ckpt = tm.ShardedCheckpoint(directory, every_n_steps=2, keep_last=1)
    trainer = tm.Trainer(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        torch.nn.MSELoss(),
        zero_stage=2,
        callbacks=[ckpt, DiskTrouble()],
        progress=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(data, epochs=1, batch_size=16)
    seen["warned"] = [str(w.message) for w in caught if "was not saved" in str(w.message)]
    seen["steps"] = trainer.global_step
    seen["final"] = [os.path.basename(p) for p in ckpt.manager.checkpoints()]

    # The synchronous path: rank 1's small per-rank file fails before any DCP collective.
    manager = CheckpointManager(os.path.join(directory, "sync"), keep_last=1)
    assert manager.save(1, {"model": model, "trainer": {"step": 1}}) is not None
    if rank == 1:
        _limit_file_size(1 << 10)
    seen["sync_result"] = manager.save(2, {"model": model, "trainer": {"step": 2}})
    if rank == 1:
        _limit_file_size(None)
    seen["sync_failures"] = list(manager.failures)
    seen["sync_kept"] = [os.path.basename(p) for p in manager.checkpoints()]
    seen["sync_leftovers"] = sorted(os.listdir(os.path.join(directory, "sync")))
    return seen


def test_a_failed_write_is_reported_the_previous_checkpoint_kept_and_training_goes_on():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_train_through_a_failed_save, world_size=2, args=(tmp,), timeout=200)
    for rank, seen in enumerate(results):
        assert seen["steps"] == 8  # training went on to the end
        assert seen["at_failure"] == ["step_00000002"]  # kept, though keep_last=1 and step 4 was saved after it
        assert seen["leftovers"] == ["step_00000002"]  # the failed step_00000004.tmp removed
        (message,) = seen["failures"]
        assert "step 4 was not saved" in message and "step_00000004.tmp" in message
        assert "rank 1: " in message and "File too large" in message and "rank 0: " not in message
        assert "Free space there: " in message and "MiB" in message
        assert "step_00000002 is kept" in message
        assert seen["final"] == ["step_00000008"]  # later saves commit again
        (sync_message,) = seen["sync_failures"]
        assert seen["sync_result"] is None and seen["sync_kept"] == ["step_00000001"]
        assert seen["sync_leftovers"] == ["step_00000001"]
        assert "step 2 was not saved" in sync_message and "rank 1: " in sync_message
        assert "File too large" in sync_message
    assert len(results[0]["warned"]) == 1 and results[1]["warned"] == []  # rank 0 warns, once per failure
