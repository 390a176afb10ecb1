"""PowerSGD across hosts, on 4 gloo processes posing as 2 hosts x 2 (``TRAINMESH_HOST_ID``).

Across hosts each host sums its gradients in fp32 into its local rank 0, and only those leaders
run PowerSGD (trainmesh.comm.powersgd_exchange). Checked here: the error feedback lives on the
leaders and totals what the flat algorithm's residuals total; it goes into checkpoints (a resumed
run equals the uninterrupted one); a flat run's checkpoint resumed across hosts keeps its residual
mass (the non-leaders hand theirs over); the byte counter says who sends across hosts.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from trainmesh.testing import run_distributed

from compression_task import make_data, make_model

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

# 30 steps/epoch. Flat and across-hosts runs agree to ~1e-6 after one epoch; PowerSGD's power
# iteration amplifies summation-order differences (1e-3 after three epochs, as with the
# hierarchical all-reduce of P this replaced), so runs are compared over one epoch from the same state.
BATCH, EPOCHS = 64, 2


def train(hierarchical: bool, *, epochs: int = EPOCHS, checkpoint: str | None = None, resume: bool = False) -> dict:
    import trainmesh as tm

    callbacks = [tm.ModelCheckpoint(checkpoint, save_best=False)] if checkpoint else None
    model = make_model()
    trainer = tm.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), torch.nn.MSELoss(),
                         compression="powersgd:2", hierarchical_allreduce=hierarchical, callbacks=callbacks,
                         progress=False)
    history = trainer.fit(make_data(), epochs=epochs, batch_size=BATCH, resume=resume)
    state = trainer.communication.compressor.state_dict()
    return {"hierarchical": trainer.communication.hierarchical, "losses": [s["loss"] for s in history.steps],
            "params": {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()},
            "residuals": state["residuals"], "q_memory": state["q_memory"],
            "bytes": [(s.get("comm_bytes"), s.get("comm_wire_bytes")) for s in history.steps]}


def _job(directory: str) -> dict:
    rank = int(os.environ["RANK"])
    os.environ.update(TRAINMESH_HOST_ID=f"host{rank // 2}", LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))
    hier_dir, flat_dir = os.path.join(directory, "hier"), os.path.join(directory, "flat")
    out = {"flat": train(False, epochs=1, checkpoint=flat_dir), "hier": train(True, epochs=1, checkpoint=hier_dir),
           "flat_2": train(False), "hier_2": train(True)}
    out["hier_resumed"] = train(True, checkpoint=hier_dir, resume=True)
    out["flat_resumed_across_hosts"] = train(True, checkpoint=flat_dir, resume=True)
    return out


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as directory:
        return run_distributed(_job, world_size=4, args=(directory,), timeout=350)


def _same_params(a: dict, b: dict, tol: float) -> None:
    for name, value in a["params"].items():
        torch.testing.assert_close(b["params"][name], value, rtol=tol, atol=tol)


def test_across_hosts_equals_the_flat_algorithm(runs):
    for rank in range(4):
        assert runs[rank]["hier"]["hierarchical"] and not runs[rank]["flat"]["hierarchical"]
        _same_params(runs[rank]["flat"], runs[rank]["hier"], 1e-5)


def test_leaders_hold_the_error_feedback_and_it_totals_the_flat_residuals(runs):
    leaders, others = (0, 2), (1, 3)
    keys = set(runs[0]["flat"]["residuals"])
    assert keys and all(set(runs[r]["hier"]["residuals"]) == keys for r in leaders)
    assert all(not runs[r]["hier"]["residuals"] for r in others)
    for key in keys:
        flat_total = sum(runs[r]["flat"]["residuals"][key] for r in range(4))
        hier_total = sum(runs[r]["hier"]["residuals"][key] for r in leaders)
        assert float(flat_total.abs().max()) > 1e-3  # something is held back
        # Summation order again: the replaced hierarchical all-reduce of P measured 3.5e-4 here too;
        # a residual kept in the wrong units (per process instead of per host) would be off by O(1).
        assert float((hier_total - flat_total).norm() / flat_total.norm()) < 1e-3, key
        torch.testing.assert_close(runs[0]["hier"]["q_memory"][key], runs[2]["hier"]["q_memory"][key],
                                   rtol=0, atol=0)


def test_error_feedback_checkpoints_and_the_resumed_run_equals_the_uninterrupted_one(runs):
    for rank in range(4):
        want, got = runs[rank]["hier_2"], runs[rank]["hier_resumed"]
        _same_params(want, got, 1e-6)
        assert set(got["residuals"]) == set(want["residuals"])
        for key, value in want["residuals"].items():
            torch.testing.assert_close(got["residuals"][key], value, rtol=1e-5, atol=1e-6)


def test_a_flat_checkpoint_resumed_across_hosts_keeps_the_residual_mass(runs):
    # Equal to the uninterrupted flat run only if every process's residual reached the exchange.
    for rank in range(4):
        _same_params(runs[rank]["flat_2"], runs[rank]["flat_resumed_across_hosts"], 1e-5)
    assert all(not runs[r]["flat_resumed_across_hosts"]["residuals"] for r in (1, 3))


def test_only_leaders_send_across_hosts(runs):
    for rank in range(4):
        for sent, wire in runs[rank]["hier"]["bytes"]:
            if rank in (0, 2):
                assert sent > 0 and wire > 0
            else:
                assert sent == 0 and wire is None
