"""CheckpointManager on one process: commit protocol, validation, fallback, retention, round trip."""

from __future__ import annotations

import json
import os
import random
import warnings

import numpy as np
import pytest
import torch

from trainmesh.checkpoint import CheckpointManager, export_consolidated, load_initial_weights
from trainmesh.checkpoint import integrity


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _state(step=0):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched, "trainer": {"global_step": step, "epoch": 0}}


def _dcp_file(path):
    return next(
        os.path.join(path, "dcp", n) for n in sorted(os.listdir(os.path.join(path, "dcp"))) if n.endswith(".distcp")
    )


def test_marker_is_written_last_and_covers_every_file(tmp_path, monkeypatch):
    seen = {}
    original = integrity.write_json_atomic

    def spy(path, payload):
        if path.endswith(integrity.MARKER):
            directory = os.path.dirname(path)
            seen["tmp_named"] = directory.endswith(".tmp")
            seen["files_then"] = set(integrity.file_checksums(directory))
        return original(path, payload)

    monkeypatch.setattr(integrity, "write_json_atomic", spy)
    path = CheckpointManager(tmp_path).save(7, _state())
    marker = integrity.read_marker(path)
    assert seen["tmp_named"] and seen["files_then"] == set(marker["files"])
    assert set(marker["files"]) == set(integrity.file_checksums(path))
    assert {"dcp/.metadata", "rank_00000.pt", "shared.pt", "meta.json"} <= set(marker["files"])
    assert marker["step"] == 7 and marker["world_size"] == 1 and os.path.basename(path) == "step_00000007"
    assert integrity.validate(path) is None


def test_crash_before_commit_leaves_only_tmp_which_latest_ignores(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, _state())

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(integrity, "seal", crash)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, _state())
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002.tmp"]
    assert manager.latest() == good
    manager.save(3, _state())  # the next save clears the leftover
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000003"]


def test_tmp_dir_with_a_marker_is_still_ignored(tmp_path):
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, _state())
    fake = tmp_path / "step_00000099.tmp"
    fake.mkdir()
    (fake / integrity.MARKER).write_text(json.dumps({"step": 99, "files": {}}))
    assert manager.latest() == good and manager.checkpoints() == [good]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete_marker"])
def test_damaged_latest_falls_back_to_previous_with_a_warning(tmp_path, damage):
    manager = CheckpointManager(tmp_path)
    previous = manager.save(1, _state())
    newest = manager.save(2, _state())
    victim = _dcp_file(newest)
    if damage == "corrupt":
        data = bytearray(open(victim, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(victim, "wb").write(bytes(data))
    elif damage == "truncate":
        os.truncate(victim, os.path.getsize(victim) // 2)
    else:
        os.remove(os.path.join(newest, integrity.MARKER))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = manager.latest()
    assert chosen == previous
    # Each names what it skipped: the damaged file, or the directory whose marker is gone.
    named = newest if damage == "delete_marker" else victim
    assert any(named in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_retention_keeps_last_k_and_the_best(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, keep_best=("val_loss", "min"))
    for step, loss in zip(range(1, 6), [5.0, 1.0, 4.0, 3.0, 2.0]):
        manager.save(step, {"trainer": {"global_step": step}}, metrics={"val_loss": loss})
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000004", "step_00000005"]
    assert manager.best() == str(tmp_path / "step_00000002")
    assert manager.latest() == str(tmp_path / "step_00000005")


def test_round_trip_restores_model_optimizer_scheduler_rng_and_metadata(tmp_path):
    saved = _state(step=11)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    path = CheckpointManager(tmp_path).save(11, saved, metrics={"acc": 0.5})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())

    fresh = {"model": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))}
    fresh["optimizer"] = torch.optim.Adam(fresh["model"].parameters(), lr=0.1)
    fresh["scheduler"] = torch.optim.lr_scheduler.StepLR(fresh["optimizer"], step_size=1, gamma=0.5)
    meta = CheckpointManager(tmp_path).load("latest", fresh)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert meta["trainer"] == {"global_step": 11, "epoch": 0} and meta["step"] == 11 and meta["metrics"] == {"acc": 0.5}
    for a, b in zip(saved["model"].parameters(), fresh["model"].parameters()):
        assert torch.equal(a, b)
    assert fresh["scheduler"].get_last_lr() == saved["scheduler"].get_last_lr()
    sa, sb = saved["optimizer"].state_dict()["state"], fresh["optimizer"].state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    assert json.load(open(os.path.join(path, "meta.json")))["trainer"]["global_step"] == 11


def test_async_save_commits_on_wait(tmp_path):
    manager = CheckpointManager(tmp_path, async_save=True)
    state = _state()
    path = manager.save(5, state)
    assert manager.last_blocking_s is not None
    manager.close()
    assert manager.latest() == path and integrity.validate(path) is None


def test_no_checkpoint_yet_loads_nothing(tmp_path):
    assert CheckpointManager(tmp_path / "none").load("latest", _state()) is None


def test_export_and_initial_weights(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    model = _model()
    path = export_consolidated(tmp_path / "m.safetensors", model)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    plain.load_state_dict(safetensors.load_file(path))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    torch.save(model.state_dict(), tmp_path / "m.pt")
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    load_initial_weights(other, tmp_path / "m.pt")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_best": ("loss", "lowest")}, {"keep_best": "loss"}])
def test_bad_arguments_name_the_value(tmp_path, kwargs):
    with pytest.raises(ValueError, match="Received"):
        CheckpointManager(tmp_path, **kwargs)


def test_bad_paths_and_steps(tmp_path):
    with pytest.raises(ValueError, match="step=-1"):
        CheckpointManager(tmp_path).save(-1, _state())
    with pytest.raises(ValueError, match="safetensors"):
        export_consolidated(tmp_path / "m.bin", _model())
    with pytest.raises(ValueError, match="COMPLETE"):
        CheckpointManager(tmp_path).load(tmp_path, _state())
