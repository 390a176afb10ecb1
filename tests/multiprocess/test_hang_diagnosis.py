"""A deliberately stalled rank: the survivors' error names it, the step and the operation."""

from __future__ import annotations

import os
import time

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180), pytest.mark.xdist_group("serial")]

STALL_AT_STEP = 3  # global step (1-based) that rank 1 never reaches in time
STALL_S = 12.0  # the longest rank 1 stalls: 3 collective timeouts


def _stalling_job(survivor_done: str) -> dict:
    import trainmesh as tm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))

    class StallRank1(tm.Callback):
        def on_train_batch_begin(self, step, logs=None):
            if tm.rank() == 1 and self.trainer.global_step + 1 == STALL_AT_STEP:
                # Stalled until rank 0 has raised (it writes survivor_done), STALL_S at most: sleeping on past
                # that proved nothing more (the survivor's result was in) and cost ~8 s of each run.
                deadline = time.monotonic() + STALL_S
                while time.monotonic() < deadline and not os.path.exists(survivor_done):
                    time.sleep(0.05)

    trainer = tm.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(), callbacks=[StallRank1()], progress=False
    )
    started = time.monotonic()
    try:
        trainer.fit((torch.randn(64, 4), torch.randn(64, 1)), epochs=1, batch_size=8)
        return {"error": None}
    except Exception as error:  # noqa: BLE001 - what it says is the point
        after_s = time.monotonic() - started
        if tm.rank() == 0:
            open(survivor_done, "w").close()
        return {
            "type": type(error).__name__,
            "error": str(error),
            "after_s": after_s,
            "missing": getattr(error, "missing_ranks", None),
            "step": getattr(error, "step", None),
        }


def test_stalled_rank_is_named_by_the_survivor(tmp_path):
    # Collectives time out after 4 s; rank 1 stalls before its third step until rank 0 has raised, 12 s at most.
    done = str(tmp_path / "survivor_done")
    results = run_distributed(_stalling_job, world_size=2, args=(done,), timeout=120, collective_timeout=4)
    survivor = results[0]
    assert survivor["type"] == "CollectiveTimeoutError", survivor
    assert survivor["missing"] == [1] and survivor["step"] == STALL_AT_STEP
    assert "rank(s) [1]" in survivor["error"] and f"step {STALL_AT_STEP}" in survivor["error"]
    assert "forward/backward" in survivor["error"] or "all-reduce" in survivor["error"]
    assert survivor["after_s"] < STALL_S  # it did not wait for the sleeper
    assert results[1]["error"] is not None  # the sleeper finds its peer gone, and says so too
