"""``trainmesh plot`` end to end: real ``python -m trainmesh plot`` processes on LogWriter output."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

from trainmesh.trainer.log_writer import LogWriter

pytestmark = pytest.mark.timeout(60)

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed (pip install 'trainmesh[plot]')"
)


def run_plot(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainmesh", "plot", *args], cwd=cwd, capture_output=True, text=True, timeout=50
    )


def read_matplotlib_png(path: Path):
    """The image as a float array (H, W, 3 or 4), after checking that matplotlib wrote the file."""
    from matplotlib.image import imread

    assert b"Matplotlib version" in path.read_bytes()[:200], "no matplotlib Software chunk"
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.shape[2] in (3, 4)
    return image


def color_pixels(image, hex_color: str, tol: float = 0.02) -> int:
    """How many pixels are ``hex_color`` (within ``tol`` per channel)."""
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return int((abs(image[..., :3] - rgb) <= tol).all(axis=-1).sum())


def write_logs(log_dir: Path, *, epochs: int = 3, steps_per_epoch: int = 20, val: bool = True) -> None:
    with LogWriter(log_dir, tensorboard=False) as writer:
        global_step = 0
        for epoch in range(epochs):
            for step in range(1, steps_per_epoch + 1):
                global_step += 1
                loss = math.nan if global_step == 7 else 2.0 * math.exp(-global_step / 20) + 0.1
                writer.log_step(
                    {
                        "epoch": epoch,
                        "step": step,
                        "global_step": global_step,
                        "loss": loss,
                        "lr": 1e-3,
                        "samples_per_s": 300.0 + step,
                        "skipped": 0,
                    }
                )
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
    image = read_matplotlib_png(out)
    # Drawn, not blank: the step loss (tab:blue), train/held-out loss per epoch (tab:orange,
    # tab:green) and the throughput (tab:purple).
    for color, at_least in (("#1f77b4", 200), ("#ff7f0e", 20), ("#2ca02c", 20), ("#9467bd", 200)):
        assert color_pixels(image, color) >= at_least, color
    # The throughput curve is in the lower panel, the loss curves in the upper one.
    half = image.shape[0] // 2
    assert color_pixels(image[half:], "#9467bd") > 10 * color_pixels(image[:half], "#9467bd")
    assert color_pixels(image[:half], "#1f77b4") > 10 * color_pixels(image[half:], "#1f77b4")
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
    image = read_matplotlib_png(out)
    assert color_pixels(image, "#ff7f0e") >= 20  # the epoch train loss
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
    code = (
        "import sys; sys.modules['matplotlib'] = None; "
        "from trainmesh.launcher.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "plot", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 1
    assert "pip install 'trainmesh[plot]'" in result.stderr


def test_listed_in_help() -> None:
    from trainmesh.launcher import cli

    assert "plot" in cli.build_parser().format_help()
