"""``trainmesh plot`` end to end: real ``python -m trainmesh plot`` processes on LogWriter output."""

from __future__ import annotations

import importlib.util
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from trainmesh.trainer.log_writer import LogWriter

pytestmark = pytest.mark.timeout(60)

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed (pip install 'trainmesh[plot]')")


def run_plot(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmesh", "plot", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=50)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == _PNG_SIGNATURE, "not a PNG file"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_logs(log_dir: Path, *, epochs: int = 3, steps_per_epoch: int = 20, val: bool = True) -> None:
    with LogWriter(log_dir, tensorboard=False) as writer:
        global_step = 0
        for epoch in range(epochs):
            for step in range(1, steps_per_epoch + 1):
                global_step += 1
                loss = math.nan if global_step == 7 else 2.0 * math.exp(-global_step / 20) + 0.1
                writer.log_step({"epoch": epoch, "step": step, "global_step": global_step, "loss": loss,
                                 "lr": 1e-3, "samples_per_s": 300.0 + step, "skipped": 0})
            record = {"epoch": epoch, "loss": 2.0 * math.exp(-global_step / 20) + 0.15}
            if val:
                record["val_loss"] = record["loss"] + 0.05
            writer.log_epoch(record)


@needs_matplotlib
def test_plot_default_out(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    write_logs(log_dir)
    result = run_plot(str(log_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = log_dir / "curves.png"
    assert out.stat().st_size > 0
    width, height = png_size(out)
    assert width > 100 and height > 100
    assert str(out) in result.stdout


@needs_matplotlib
def test_plot_out_path_and_epoch_only_logs(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    with LogWriter(log_dir, tensorboard=False) as writer:
        for epoch in range(4):
            writer.log_epoch({"epoch": epoch, "loss": 1.0 / (epoch + 1), "val_loss": math.inf})
    out = tmp_path / "figures" / "run1.png"  # parent created
    result = run_plot(str(log_dir), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert png_size(out)[0] > 100
    assert not (log_dir / "curves.png").exists()


def test_empty_dir_is_an_error(tmp_path: Path) -> None:
    result = run_plot(str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert "no training logs" in result.stderr and str(tmp_path) in result.stderr
    assert not (tmp_path / "curves.png").exists()


def test_missing_dir_is_an_error(tmp_path: Path) -> None:
    result = run_plot(str(tmp_path / "nope"), cwd=tmp_path)
    assert result.returncode == 2
    assert "not a directory" in result.stderr


def test_missing_matplotlib_says_how_to_install(tmp_path: Path) -> None:
    write_logs(tmp_path, epochs=1, steps_per_epoch=3, val=False)
    # A None entry in sys.modules makes `import matplotlib` fail as if it were not installed.
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "from trainmesh.launcher.cli import main; sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, "plot", str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 1
    assert "pip install 'trainmesh[plot]'" in result.stderr


def test_listed_in_help() -> None:
    from trainmesh.launcher import cli

    assert "plot" in cli.build_parser().format_help()
