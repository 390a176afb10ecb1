"""Checkpoints that run no code and never silently restart training, on one process (issue 35, 1-2).

A flipped byte in ``last.pt`` is caught by its checksum and the run resumes from ``last.prev.pt``
with a warning naming the file; a pickle that would run code is refused (single files, per-rank
extras, DCP metadata and DCP's non-tensor items); when every checkpoint is damaged ``fit(resume=True)``
raises before the first step, listing each one and why, and ``on_invalid_checkpoint="start_over"``
is the explicit way to begin again; a directory without its marker is reported by name.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import trainmesh as tm
from trainmesh.checkpoint import CheckpointManager, NoValidCheckpointError, integrity
from trainmesh.checkpoint.single_file import (
    check_checkpoint_file,
    checksum_path,
    load_plain,
    previous_path,
    save_checkpoint_file,
    save_plain,
)
from trainmesh.checkpoint.survey import survey_files

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_process_group_left_behind")]

torch.manual_seed(0)
X = torch.randn(32, 4)
Y = X.sum(1, keepdim=True)


def _fit(directory, epochs, *, sharded=False, steps=None, **fit_kwargs):
    """4 steps per epoch; a checkpoint at every epoch end. ``steps`` collects the steps taken."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    callback = (
        tm.ShardedCheckpoint(directory, async_save=False) if sharded else tm.ModelCheckpoint(directory, save_best=False)
    )
    counter = None if steps is None else tm.LambdaCallback(on_train_batch_begin=lambda step, logs: steps.append(step))
    trainer = tm.Trainer(
        model,
        torch.optim.Adam(model.parameters(), lr=0.01),
        torch.nn.MSELoss(),
        callbacks=[callback] + ([counter] if counter else []),
        progress=False,
    )
    trainer.fit(TensorDataset(X, Y), epochs=epochs, batch_size=8, **fit_kwargs)
    return trainer


def _flip_byte(path, where=0.5):
    data = bytearray(open(path, "rb").read())
    data[int(len(data) * where)] ^= 0x01
    open(path, "wb").write(bytes(data))


class RunsCode:
    """Unpickling this creates a directory: the stand-in for any code a crafted file could run."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return os.mkdir, (self.target,)


def _params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


# --- item 1: checksummed, atomic, weights_only -----------------------------------------------


def test_flipped_byte_in_last_pt_falls_back_to_the_previous_one_with_a_warning(tmp_path):
    reference = _params(_fit(tmp_path / "reference", 3))
    ckpt = tmp_path / "ckpt"
    _fit(ckpt, 2)  # last.pt after epoch 2 (step 8), last.prev.pt after epoch 1 (step 4)
    assert sorted(os.listdir(ckpt)) == ["last.prev.pt", "last.prev.pt.sha256", "last.pt", "last.pt.sha256"]
    _flip_byte(ckpt / "last.pt")
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(ckpt, 3, resume=True, steps=steps)
    messages = [str(w.message) for w in caught]
    assert any(str(ckpt / "last.pt") in m and "sha256" in m for m in messages), messages
    assert len(steps) == 8 and resumed.global_step == 12  # epochs 1 and 2 again, from step 4
    for a, b in zip(reference, _params(resumed)):
        assert torch.equal(a, b)  # exactly the uninterrupted run


@pytest.mark.parametrize("where", [0.0, 0.01, 0.5, 0.99])
def test_checksum_catches_a_flipped_byte_anywhere(tmp_path, where):
    path = save_checkpoint_file({"w": torch.arange(1000.0), "step": 3}, tmp_path / "last.pt")
    assert check_checkpoint_file(path) is None
    _flip_byte(path, where)
    problem = check_checkpoint_file(path)
    assert problem is not None and path in problem and "sha256" in problem


def test_a_crash_anywhere_in_a_save_leaves_a_valid_checkpoint(tmp_path, monkeypatch):
    real_replace, real_link = os.replace, os.link
    for crash_at in range(8):
        directory = tmp_path / f"crash{crash_at}"
        path = str(directory / "last.pt")
        save_checkpoint_file({"step": 1}, path)
        save_checkpoint_file({"step": 2}, path)
        calls = []

        def counting(real):
            def call(*args, **kwargs):
                calls.append(args)
                if len(calls) > crash_at:
                    raise KeyboardInterrupt("killed mid-save")
                return real(*args, **kwargs)

            return call

        monkeypatch.setattr(os, "replace", counting(real_replace))
        monkeypatch.setattr(os, "link", counting(real_link))
        try:
            save_checkpoint_file({"step": 3}, path)
        except KeyboardInterrupt:
            pass
        monkeypatch.undo()
        found = survey_files([path, previous_path(path)])
        assert found.chosen is not None, (crash_at, found)
        assert load_plain(found.chosen)["step"] in (2, 3)


def test_a_pickle_that_would_run_code_is_refused_in_last_pt(tmp_path):
    target = tmp_path / "code_ran"
    ckpt = tmp_path / "ckpt"
    _fit(ckpt, 1)
    last = ckpt / "last.pt"
    torch.save({"model": RunsCode(target)}, last)  # whoever can write the file can write its checksum
    with open(checksum_path(str(last)), "w") as fh:
        fh.write(f"{integrity.sha256_file(str(last))}  last.pt\n")
    with pytest.raises(pickle.UnpicklingError, match=r"last\.pt.*weights_only"):
        _fit(ckpt, 2, resume=True)
    assert not target.exists()
    torch.load(last, weights_only=False)  # the control: this file does run code when trusted
    assert target.exists()


def test_a_pickle_that_would_run_code_is_refused_in_sharded_extras_and_dcp_metadata(tmp_path):
    target = tmp_path / "code_ran"

    def state():
        model = torch.nn.Linear(4, 2)
        return {"model": model, "optimizer": torch.optim.Adam(model.parameters()), "trainer": {"step": 1}}

    for victim in ("rank_00000.pt", "shared.pt", os.path.join("dcp", ".metadata")):
        path = CheckpointManager(tmp_path / victim.replace(os.sep, "_")).save(1, state())
        with open(os.path.join(path, victim), "wb") as fh:
            pickle.dump(RunsCode(target), fh) if victim.endswith("metadata") else torch.save(RunsCode(target), fh)
        marker = integrity.read_marker(path)  # re-sealed: the checksums match the crafted file
        marker["files"] = integrity.file_checksums(path)
        integrity.write_json_atomic(os.path.join(path, integrity.MARKER), marker)
        with pytest.raises(pickle.UnpicklingError, match="code|weights_only"):
            CheckpointManager(os.path.dirname(path)).load("latest", state())
        assert not target.exists(), victim


def test_dcp_non_tensor_items_are_read_with_weights_only(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from trainmesh._torch.dcp_reader import SafeFileSystemReader

    target = tmp_path / "code_ran"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: one process"
        dcp.save({"plain": {"lr": 0.5}, "crafted": RunsCode(target)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
        loaded = {"plain": {"lr": 0.0}}
        dcp.load(
            loaded,
            checkpoint_id=str(tmp_path / "c"),
            storage_reader=SafeFileSystemReader(str(tmp_path / "c")),
            no_dist=True,
        )
        assert loaded["plain"]["lr"] == 0.5  # plain items still load
        with pytest.raises(CheckpointException, match="'crafted'.*weights_only.*GLOBAL posix.mkdir"):
            dcp.load(
                {"crafted": None},
                checkpoint_id=str(tmp_path / "c"),
                storage_reader=SafeFileSystemReader(str(tmp_path / "c")),
                no_dist=True,
            )
    assert not target.exists()


def test_state_that_would_need_unpickling_code_is_refused_at_save(tmp_path):
    with pytest.raises(TypeError, match="numpy"):
        save_plain({"rng": np.random.get_state()}, str(tmp_path / "x.pt"), what="per-rank extras")
    assert not (tmp_path / "x.pt").exists()


# --- item 2: no silent fresh start ----------------------------------------------------------


def _damage_all(ckpt, sharded):
    if sharded:
        newest, oldest = sorted(os.listdir(ckpt), reverse=True)
        _flip_byte(os.path.join(ckpt, newest, "rank_00000.pt"))
        os.remove(os.path.join(ckpt, oldest, integrity.MARKER))
        return {os.path.join(ckpt, newest): "sha256", os.path.join(ckpt, oldest): "COMPLETE.json is missing"}
    _flip_byte(ckpt / "last.pt")
    os.truncate(ckpt / "last.prev.pt", 100)
    return {str(ckpt / "last.pt"): "sha256", str(ckpt / "last.prev.pt"): "sha256"}


@pytest.mark.parametrize("sharded", [False, True], ids=["model_checkpoint", "sharded"])
def test_all_checkpoints_damaged_stops_before_training_and_lists_each(tmp_path, sharded):
    ckpt = tmp_path / "ckpt"
    _fit(ckpt, 2, sharded=sharded)
    expected = _damage_all(ckpt, sharded)
    steps = []
    with pytest.raises(NoValidCheckpointError) as raised:
        _fit(ckpt, 3, sharded=sharded, resume=True, steps=steps)
    assert steps == []  # not one step trained
    message = str(raised.value)
    assert "on_invalid_checkpoint='start_over'" in message
    for path, why in expected.items():
        line = next(line for line in message.splitlines() if line.startswith(f"  - {path}:"))
        assert why in line, line
    assert [p for p, _ in raised.value.rejected] == list(expected)

    # The explicit choice: start over, the rejected checkpoints kept aside, not deleted.
    steps = []
    fresh = _fit(ckpt, 1, sharded=sharded, resume=True, on_invalid_checkpoint="start_over", steps=steps)
    assert len(steps) == 4 and fresh.global_step == 4
    assert all(os.path.exists(path + ".rejected") for path in expected)
    _fit(ckpt, 2, sharded=sharded, resume=True)  # and the new checkpoints resume without complaint


def test_a_directory_without_a_marker_is_reported_by_name(tmp_path):
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, {"trainer": {"step": 1}})
    no_marker = manager.save(2, {"trainer": {"step": 2}})
    truncated = manager.save(3, {"trainer": {"step": 3}})
    os.remove(os.path.join(no_marker, integrity.MARKER))
    marker = os.path.join(truncated, integrity.MARKER)
    os.truncate(marker, os.path.getsize(marker) // 2)
    with pytest.warns(RuntimeWarning) as caught:
        assert manager.latest() == good
    messages = [str(w.message) for w in caught]
    assert any(no_marker in m and "COMPLETE.json is missing" in m for m in messages), messages
    assert any(truncated in m and "truncated" in m for m in messages), messages


def test_an_old_format_checkpoint_is_named_not_loaded(tmp_path):
    path = CheckpointManager(tmp_path).save(1, {"trainer": {"step": 1}})
    marker = integrity.read_marker(path)
    marker["format"] = 1
    integrity.write_json_atomic(os.path.join(path, integrity.MARKER), marker)
    with pytest.warns(RuntimeWarning, match="format 1"):
        found = CheckpointManager(tmp_path).survey()
    assert found.chosen is None and found.rejected[0][0] == path and "format 1" in found.rejected[0][1]


def test_no_checkpoint_yet_starts_from_step_zero(tmp_path):
    steps = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _fit(tmp_path / "empty", 1, resume=True, steps=steps)
    assert len(steps) == 4


def test_bad_on_invalid_checkpoint_is_named(tmp_path):
    with pytest.raises(ValueError, match="Received: on_invalid_checkpoint='fresh'"):
        _fit(tmp_path, 1, resume=True, on_invalid_checkpoint="fresh")


def test_a_named_file_without_a_checksum_loads_with_a_warning(tmp_path):
    ckpt = tmp_path / "ckpt"
    _fit(ckpt, 1)
    os.remove(checksum_path(str(ckpt / "last.pt")))
    with pytest.warns(RuntimeWarning, match="unchecked"):
        trainer = _fit(tmp_path / "other", 2, resume=str(ckpt / "last.pt"))
    assert trainer.global_step == 8


def test_marker_json_is_unchanged_in_shape(tmp_path):
    path = CheckpointManager(tmp_path).save(4, {"trainer": {"step": 4}})
    marker = json.load(open(os.path.join(path, integrity.MARKER)))
    assert marker["format"] == integrity.FORMAT_VERSION == 2 and marker["step"] == 4
