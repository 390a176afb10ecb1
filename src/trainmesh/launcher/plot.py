"""``trainmesh plot``: draw the training curves of a log directory written by the Trainer to a PNG.

Reads ``steps.jsonl`` / ``epochs.jsonl`` (see :mod:`trainmesh.trainer.log_writer`) and draws loss per
global step with the epoch-end train and validation losses on the same axis, and samples/s per step.
Needs matplotlib (``pip install 'trainmesh[plot]'``); draws off-screen with the Agg backend, so it
works on a headless node.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

_INSTALL_HINT = "pip install 'trainmesh[plot]'"
# Above this many points a moving average is drawn over the raw (faint) step loss: per-step loss
# is noisy enough that the trend is otherwise hard to read.
_SMOOTH_FROM = 30


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``trainmesh plot``."""
    parser = subparsers.add_parser(
        "plot",
        help="draw loss and throughput curves of a training log directory to a PNG",
        description="Draw loss per global step (with per-epoch train and validation loss) and "
        "samples/s per step from the steps.jsonl/epochs.jsonl files of LOG_DIR. Needs matplotlib: "
        f"{_INSTALL_HINT}.",
    )
    parser.add_argument("log_dir", metavar="LOG_DIR", help="directory a trainmesh LogWriter wrote")
    parser.add_argument("--out", metavar="PATH", default=None, help="PNG file to write (default: LOG_DIR/curves.png)")
    return parser


def _load(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    # Imported here so registering the command costs `trainmesh --help` nothing.
    from trainmesh.trainer.log_writer import read_log

    try:
        return read_log(log_dir, kind)  # type: ignore[arg-type]
    except FileNotFoundError:
        return []


def _series(records: list[dict[str, Any]], key: str, x_key: str) -> tuple[list[float], list[float]]:
    """(x, y) of the records that have a number under ``key``; x is ``x_key`` or the record's index.

    Non-finite y become NaN, which matplotlib leaves as a gap (inf would wreck the axis limits).
    """
    xs, ys = [], []
    for index, record in enumerate(records):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        x = record.get(x_key, index)
        xs.append(float(x) if isinstance(x, (int, float)) else float(index))
        ys.append(float(value) if math.isfinite(value) else math.nan)
    return xs, ys


def _moving_average(ys: list[float], window: int) -> list[float]:
    """Trailing mean over the finite values of the last ``window`` points (NaN if none)."""
    out = []
    for i in range(len(ys)):
        chunk = [y for y in ys[max(0, i - window + 1) : i + 1] if math.isfinite(y)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def _epoch_end_steps(steps: list[dict[str, Any]]) -> dict[Any, float]:
    """epoch -> last global step logged in it, to place epoch values on the step axis."""
    ends: dict[Any, float] = {}
    for index, record in enumerate(steps):
        if "epoch" in record:
            ends[record["epoch"]] = float(record.get("global_step", index))
    return ends


def _nonfinite_note(ys: list[float]) -> str:
    bad = sum(1 for y in ys if math.isnan(y))
    return f" ({bad} non-finite not drawn)" if bad else ""


def draw(steps: list[dict[str, Any]], epochs: list[dict[str, Any]], out: Path, title: str) -> None:
    """Render the figure to ``out``. Raises ImportError when matplotlib is missing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A bare Figure on an Agg canvas: no pyplot, so no global backend switch and no GUI.
    fig = Figure(figsize=(9, 7), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_rate = fig.subplots(2, 1, sharex=bool(steps))
    fig.suptitle(title)

    x, y = _series(steps, "loss", "global_step")
    if x:
        smooth = len(y) >= _SMOOTH_FROM
        ax_loss.plot(x, y, color="tab:blue", alpha=0.35 if smooth else 1.0, linewidth=1, label="loss (step)")
        if smooth:
            window = max(5, len(y) // 50)
            ax_loss.plot(
                x, _moving_average(y, window), color="tab:blue", linewidth=1.8, label=f"loss (step, mean of {window})"
            )
    ends = _epoch_end_steps(steps)
    for key, color in (("loss", "tab:orange"), ("val_loss", "tab:green")):
        ex, ey = _series(epochs, key, "epoch")
        if not ex:
            continue
        label = f"{key} (epoch){_nonfinite_note(ey)}"
        if steps and all("global_step" in r for r in epochs if key in r):
            ex = _series(epochs, key, "global_step")[0]  # the record says where it belongs
        elif steps:
            # Epoch values go at the epoch's last step, so they line up with the step curve.
            mapped = [ends.get(int(e) if e.is_integer() else e) for e in ex]
            if None in mapped:
                # Step records without a matching "epoch": assume equal epochs, say so in the legend.
                last = max(x) if x else float(len(steps))
                mapped = [last * (k + 1) / len(ex) for k in range(len(ex))]
                label += ", placed evenly"
            ex = mapped
        ax_loss.plot(ex, ey, marker="o", color=color, label=label)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"loss{_nonfinite_note(y)}")
    ax_loss.grid(True, alpha=0.3)
    if ax_loss.get_lines():
        ax_loss.legend(loc="upper right")

    rx, ry = _series(steps, "samples_per_s", "global_step")
    if rx:
        ax_rate.plot(rx, ry, color="tab:purple", linewidth=1)
        ax_rate.set_title(f"throughput{_nonfinite_note(ry)}")
    else:
        ax_rate.set_title("throughput (no samples_per_s in the step log)")
    ax_rate.set_ylabel("samples/s")
    ax_rate.grid(True, alpha=0.3)
    ax_rate.set_xlabel("global step" if steps else "epoch")
    if not steps:
        from matplotlib.ticker import MaxNLocator

        ax_loss.set_xlabel("epoch")
        ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))  # no "epoch 2.5" ticks
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)


def handle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Write the PNG and print its path. Exit 2 when LOG_DIR holds no logs, 1 without matplotlib."""
    log_dir = Path(args.log_dir)
    if not log_dir.is_dir():
        print(f"trainmesh plot: error: {log_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        steps, epochs = _load(log_dir, "steps"), _load(log_dir, "epochs")
    except (OSError, ValueError) as exc:
        print(f"trainmesh plot: error: cannot read the logs in {log_dir}: {exc}", file=sys.stderr)
        return 2
    if not steps and not epochs:
        print(
            f"trainmesh plot: error: no training logs in {log_dir} (expected steps.jsonl or "
            "epochs.jsonl, written by a Trainer with log_dir set)",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out) if args.out else log_dir / "curves.png"
    try:
        draw(steps, epochs, out, title=str(log_dir))
    except ImportError as exc:
        print(
            f"trainmesh plot: error: plotting needs matplotlib ({exc}); install it with: {_INSTALL_HINT}",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {out}")
    return 0
