"""Every rank reaches the same resume decision (issue 35, item 2), on a real gloo group of 2.

Rank 0 checks the checkpoints and tells the others, so when none is valid every rank raises the same
``NoValidCheckpointError`` before the first step (none waits in a collective for a peer that gave
up), and a damaged ``last.pt`` sends both ranks to ``last.prev.pt``. One launch checks the sharded
and the single-file paths.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _decisions(directory):
    import trainmesh as tm
    from trainmesh.checkpoint import NoValidCheckpointError

    g = torch.Generator().manual_seed(0)
    data = (torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))  # 2 steps of 16 per epoch

    def fit(callback, epochs, **kwargs):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        steps = []
        counter = tm.LambdaCallback(on_train_batch_begin=lambda step, logs: steps.append(step))
        trainer = tm.Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.nn.MSELoss(),
            callbacks=[callback, counter],
            progress=False,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                trainer.fit(data, epochs=epochs, batch_size=16, **kwargs)
            except NoValidCheckpointError as error:
                return "raised", [os.path.basename(p) for p, _ in error.rejected], len(steps)
        return "trained", trainer.global_step, len(steps)

    sharded = os.path.join(directory, "sharded")
    single = os.path.join(directory, "single")
    fit(tm.ShardedCheckpoint(sharded, async_save=False), 2)
    fit(tm.ModelCheckpoint(single, save_best=False), 2)
    tm.barrier()
    if tm.rank() == 0:  # damage as a crash or bit rot would: only rank 0 touches the files
        newest, oldest = sorted(os.listdir(sharded), reverse=True)
        with open(os.path.join(sharded, newest, "rank_00001.pt"), "r+b") as fh:
            fh.seek(200)
            byte = fh.read(1)
            fh.seek(200)
            fh.write(bytes([byte[0] ^ 1]))
        os.remove(os.path.join(sharded, oldest, "COMPLETE.json"))
        with open(os.path.join(single, "last.pt"), "r+b") as fh:
            fh.seek(300)
            byte = fh.read(1)
            fh.seek(300)
            fh.write(bytes([byte[0] ^ 1]))
    tm.barrier()
    return {
        "sharded": fit(tm.ShardedCheckpoint(sharded, async_save=False), 3, resume=True),
        "single_fallback": fit(tm.ModelCheckpoint(single, save_best=False), 3, resume=True),
    }


def test_every_rank_reaches_the_same_resume_decision():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_decisions, world_size=2, args=(tmp,), timeout=240)
    assert results[0] == results[1]
    assert results[0]["sharded"] == ("raised", ["step_00000004", "step_00000002"], 0)
    # last.pt (step 4) failed its checksum: both ranks resumed from last.prev.pt (step 2), trained 4 steps.
    assert results[0]["single_fallback"] == ("trained", 6, 4)
