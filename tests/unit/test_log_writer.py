"""LogWriter: JSON lines + CSV round trip, widening CSV headers, NaN/inf, TensorBoard scalars."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from trainmesh.trainer.log_writer import LogWriter, read_log, tensorboard_available

pytestmark = pytest.mark.timeout(60)


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_round_trip(tmp_path: Path) -> None:
    log_dir = tmp_path / "deep" / "logs"  # created, parents included
    steps = [{"epoch": 0, "step": s, "global_step": s, "loss": 1.0 / s, "lr": 1e-3, "skipped": 0} for s in range(1, 4)]
    with LogWriter(log_dir, tensorboard=False) as writer:
        for record in steps:
            writer.log_step(record)
        writer.log_epoch({"epoch": 0, "loss": 0.6, "val_loss": 0.7, "accuracy": 0.5})
    assert read_log(log_dir) == steps
    assert read_log(log_dir, "epochs") == [{"epoch": 0, "loss": 0.6, "val_loss": 0.7, "accuracy": 0.5}]
    columns, rows = read_csv(log_dir / "steps.csv")
    assert columns == ["epoch", "step", "global_step", "loss", "lr", "skipped"]
    assert [float(row["loss"]) for row in rows] == [1.0, 0.5, 1.0 / 3]  # repr-exact floats
    assert sorted(p.name for p in log_dir.iterdir()) == ["epochs.csv", "epochs.jsonl", "steps.csv", "steps.jsonl"]


def test_each_write_is_flushed(tmp_path: Path) -> None:
    writer = LogWriter(tmp_path, tensorboard=False)
    writer.log_step({"global_step": 1, "loss": 2.0})
    # Readable before close: a crash loses at most the line being written.
    assert read_log(tmp_path) == [{"global_step": 1, "loss": 2.0}]
    assert read_csv(tmp_path / "steps.csv")[1] == [{"global_step": "1", "loss": "2.0"}]
    writer.close()


def test_new_keys_widen_the_csv(tmp_path: Path) -> None:
    with LogWriter(tmp_path, tensorboard=False) as writer:
        writer.log_step({"global_step": 1, "loss": 1.0})
        writer.log_step({"global_step": 2, "loss": 0.9, "loss_scale": 32768.0})
        writer.log_step({"global_step": 3, "grad_norm": 2.5, "loss": 0.8})  # new key, other order
        writer.log_step({"global_step": 4, "loss": 0.7})  # keys missing
    columns, rows = read_csv(tmp_path / "steps.csv")
    assert columns == ["global_step", "loss", "loss_scale", "grad_norm"]
    assert rows == [
        {"global_step": "1", "loss": "1.0", "loss_scale": "", "grad_norm": ""},
        {"global_step": "2", "loss": "0.9", "loss_scale": "32768.0", "grad_norm": ""},
        {"global_step": "3", "loss": "0.8", "loss_scale": "", "grad_norm": "2.5"},
        {"global_step": "4", "loss": "0.7", "loss_scale": "", "grad_norm": ""},
    ]
    assert not list(tmp_path.glob("*.tmp"))
    # The JSON lines keep each record exactly as logged.
    assert read_log(tmp_path)[2] == {"global_step": 3, "grad_norm": 2.5, "loss": 0.8}


def test_nan_and_inf(tmp_path: Path) -> None:
    with LogWriter(tmp_path, tensorboard=False) as writer:
        writer.log_step(
            {
                "global_step": 1,
                "loss": math.nan,
                "grad_norm": math.inf,
                "delta": -math.inf,
                "t": torch.tensor(float("nan")),
            }
        )
    (record,) = read_log(tmp_path)
    assert math.isnan(record["loss"]) and math.isnan(record["t"])
    assert record["grad_norm"] == math.inf and record["delta"] == -math.inf
    # Strict JSON on disk (other tools reject bare NaN tokens)...
    line = (tmp_path / "steps.jsonl").read_text().strip()
    json.loads(line, parse_constant=lambda token: pytest.fail(f"non-standard JSON token {token}"))
    # ...and floats that float() / pandas parse in the CSV.
    (row,) = read_csv(tmp_path / "steps.csv")[1]
    assert row["loss"] == "nan" and row["grad_norm"] == "inf" and row["delta"] == "-inf"
    assert math.isnan(float(row["loss"]))


def test_tensor_and_numpy_values(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    with LogWriter(tmp_path, tensorboard=False) as writer:
        writer.log_step({"global_step": np.int64(3), "loss": torch.tensor(0.5), "acc": np.float32(0.25)})
    assert read_log(tmp_path) == [{"global_step": 3, "loss": 0.5, "acc": 0.25}]


def test_append_continues_and_default_starts_afresh(tmp_path: Path) -> None:
    with LogWriter(tmp_path, tensorboard=False) as writer:
        writer.log_step({"global_step": 1, "loss": 1.0})
    with LogWriter(tmp_path, tensorboard=False, append=True) as writer:
        writer.log_step({"global_step": 2, "loss": 0.5, "lr": 0.1})
    assert [r["global_step"] for r in read_log(tmp_path)] == [1, 2]
    columns, rows = read_csv(tmp_path / "steps.csv")
    assert columns == ["global_step", "loss", "lr"] and rows[0]["lr"] == "" and rows[1]["lr"] == "0.1"
    with LogWriter(tmp_path, tensorboard=False) as writer:
        writer.log_step({"global_step": 7, "loss": 0.1})
    assert read_log(tmp_path) == [{"global_step": 7, "loss": 0.1}]


def test_close_is_idempotent_and_final(tmp_path: Path) -> None:
    writer = LogWriter(tmp_path, tensorboard=False)
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.log_step({"loss": 1.0})


def test_read_log_errors_and_truncated_last_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_log(tmp_path)
    with pytest.raises(ValueError, match="kind"):
        read_log(tmp_path, "batches")  # type: ignore[arg-type]
    (tmp_path / "steps.jsonl").write_text('{"loss": 1.0}\n{"loss": 0.')  # crash mid-write
    assert read_log(tmp_path) == [{"loss": 1.0}]
    (tmp_path / "steps.jsonl").write_text('{"loss": 1.0}\ngarbage\n{"loss": 0.5}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_log(tmp_path)


def test_tensorboard_scalars(tmp_path: Path) -> None:
    # tensorboard is in the `test` extra: no skip, a missing install fails here rather than hiding the path.
    assert tensorboard_available(), "tensorboard is not installed: pip install -e '.[test]'"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with LogWriter(tmp_path) as writer:  # auto: tensorboard is installed
        assert writer.tensorboard_dir == tmp_path / "tensorboard"
        for step in (1, 2, 3):
            writer.log_step(
                {
                    "epoch": 0,
                    "step": step,
                    "global_step": step,
                    "loss": 1.0 / step,
                    "skipped": False,
                    "note": "text",
                    "grad_norm": math.nan,
                }
            )
        writer.log_epoch({"epoch": 0, "loss": 0.6, "val_loss": 0.7})
        writer.log_epoch({"epoch": 1, "loss": 0.4, "val_loss": 0.5})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"step/loss", "step/grad_norm", "epoch/loss", "epoch/val_loss"}
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("step/loss")] == [(1, 1.0), (2, 0.5), (3, 0.333333)]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("epoch/val_loss")] == [(0, 0.7), (1, 0.5)]
    assert all(math.isnan(e.value) for e in events.Scalars("step/grad_norm"))


def test_tensorboard_false_writes_no_events(tmp_path: Path) -> None:
    with LogWriter(tmp_path, tensorboard=False) as writer:
        writer.log_step({"global_step": 1, "loss": 1.0})
        assert writer.tensorboard_dir is None
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_true_without_tensorboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"trainmesh\[tensorboard\]"):
        LogWriter(tmp_path, tensorboard=True)
