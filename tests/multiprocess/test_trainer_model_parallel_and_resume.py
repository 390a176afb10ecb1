"""The Trainer on a 2x2 ModelParallel mesh equals one process; checkpoints resume exactly.

Resume: train 1 epoch with ModelCheckpoint, start a NEW Trainer with ``fit(resume=True)``
for 3 epochs total, and compare with 3 uninterrupted epochs (fp32, 1e-6).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

N, BATCH = 64, 16


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 16, generator=g)
    return x, torch.randn(N, 4, generator=g)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def model_parallel(mesh_shape, zero_stage=0):
    import trainmesh as tm

    mesh = tm.DeviceMesh(mesh_shape, ["data", "model"], devices=tm.list_devices())
    layout_map = tm.LayoutMap(mesh)
    layout_map["up.weight"] = ("model", None)
    layout_map["up.bias"] = ("model",)
    layout_map["down.weight"] = (None, "model")
    return tm.ModelParallel(layout_map=layout_map, batch_dim_name="data", zero_stage=zero_stage)


def full_params(trainer) -> dict:
    # Gathered onto the main process only (torch's full_state_dict + cpu_offload); others get {}.
    return {k: v.clone() for k, v in trainer.state_dict()["model"].items()}


def run(distribution=None, epochs=2, accum=1, max_grad_norm=1.0, callbacks=None, resume=False):
    import trainmesh as tm

    model = Net()
    trainer = tm.Trainer(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        torch.nn.MSELoss(),
        distribution=distribution,
        callbacks=callbacks,
        grad_accum_steps=accum,
        max_grad_norm=max_grad_norm,
        progress=False,
    )
    history = trainer.fit(data(), epochs=epochs, batch_size=BATCH, eval_data=data(), resume=resume)
    return trainer, history


def _single() -> dict:
    trainer, history = run()
    return {
        "losses": [s["loss"] for s in history.steps],
        "norms": [s["grad_norm"] for s in history.steps],
        "val_loss": history.history["val_loss"],
        "params": full_params(trainer),
    }


def _four(checkpoint_dir: str) -> dict:
    import trainmesh as tm

    out = {}
    for shape, stage in CONFIGS:
        trainer, history = run(model_parallel(shape, stage), accum=2)
        # The optimizer's parameter is the shard held at rest (a stage-2 model may still have its
        # gathered copy registered after the last evaluation forward).
        local = trainer.optimizer.param_groups[0]["params"][0].to_local().shape
        out[(shape, stage)] = {
            "losses": [s["loss"] for s in history.steps],
            "norms": [s["grad_norm"] for s in history.steps],
            "val_loss": history.history["val_loss"],
            "params": full_params(trainer),
            "up_local": tuple(local),
        }

    # Checkpoint + resume on DataParallel, 4 processes.
    full_trainer, _ = run(epochs=3)
    first, _ = run(epochs=1, callbacks=[tm.ModelCheckpoint(checkpoint_dir)])
    resumed, history = run(epochs=3, callbacks=[tm.ModelCheckpoint(checkpoint_dir)], resume=True)
    out["resume"] = {
        "uninterrupted": full_params(full_trainer),
        "resumed": full_params(resumed),
        "resumed_epochs": history.epoch,
        "global_step": resumed.global_step,
        "files": sorted(os.listdir(checkpoint_dir)),
    }
    return out


@pytest.fixture(scope="module")
def single():
    return run_distributed(_single, world_size=1, timeout=200)[0]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_distributed(_four, world_size=4, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout=500)


CONFIGS = [((2, 2), 0), ((1, 4), 0), ((2, 2), 2), ((2, 2), 3)]


@pytest.mark.parametrize("config", CONFIGS, ids=["2x2", "1x4", "2x2-zero2", "2x2-zero3"])
def test_model_parallel_trainer_matches_one_process(single, four, config):
    (shape, stage) = config
    for rank, result in enumerate(four):
        got = result[config]
        # fp32, Adam, clipping at 1.0 and accumulation 2 vs 1: 1e-5 relative on losses and norms.
        np.testing.assert_allclose(got["losses"], single["losses"], rtol=1e-5)
        np.testing.assert_allclose(got["norms"], single["norms"], rtol=1e-5)
        np.testing.assert_allclose(got["val_loss"], single["val_loss"], rtol=1e-5)
        # TP shards dim 0 over "model"; ZeRO then shards it again over "data" (2-D).
        assert got["up_local"] == (32 // shape[1] // (shape[0] if stage else 1), 16)
        assert (got["params"] == {}) == (rank != 0)
    for name, value in single["params"].items():
        torch.testing.assert_close(four[0][config]["params"][name], value, rtol=1e-5, atol=1e-6)
    assert max(single["norms"]) > 1.0  # clipping engaged


def test_resume_from_checkpoint_continues_exactly(four):
    for result in four:
        resume = result["resume"]
        # Each file beside its checksum; a file saved again keeps its predecessor as *.prev.pt.
        assert [f for f in resume["files"] if ".prev." not in f] == [
            "best.pt",
            "best.pt.sha256",
            "last.pt",
            "last.pt.sha256",
        ]
        assert {"last.prev.pt", "last.prev.pt.sha256"} <= set(resume["files"])
        assert resume["resumed_epochs"] == [0, 1, 2]  # history restored from the checkpoint, then extended
        assert resume["global_step"] == 3 * N // BATCH
    resume = four[0]["resume"]
    assert (
        resume["uninterrupted"].keys()
        == resume["resumed"].keys()
        == {"up.weight", "up.bias", "down.weight", "down.bias"}
    )
    for name, value in resume["uninterrupted"].items():
        torch.testing.assert_close(resume["resumed"][name], value, rtol=0, atol=1e-6)
