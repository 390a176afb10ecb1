"""A loss-curve PNG without matplotlib: a tiny rasteriser and PNG encoder (zlib + struct only).

``trainmesh demo`` promises a loss-curve PNG after ``pip install -e .``, whose dependencies
are torch and numpy only. When matplotlib is installed the demo draws with
:mod:`trainmesh.launcher.plot` instead; this module is the fallback so the promise holds
everywhere. It draws the per-step training loss (faint, with a moving average), the
per-epoch held-out loss as dots, axes with numbered ticks, and a legend.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path
from typing import Sequence

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)
BLUE_FAINT: Color = (170, 200, 235)
BLUE: Color = (31, 119, 180)
GREEN: Color = (44, 160, 44)

# 5x7 glyphs for the characters the figure writes (others draw as blanks).
_GLYPHS: dict[str, tuple[str, ...]] = {
    "0": (" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "),
    "1": ("  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "),
    "2": (" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"),
    "3": ("#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "),
    "4": ("   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "),
    "5": ("#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "),
    "6": ("  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "),
    "7": ("#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "),
    "8": (" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "),
    "9": (" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "),
    ".": ("     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "),
    "-": ("     ", "     ", "     ", " ### ", "     ", "     ", "     "),
    "(": ("   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "),
    ")": (" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "),
    "a": ("     ", "     ", " ### ", "    #", " ####", "#   #", " ####"),
    "c": ("     ", "     ", " ### ", "#    ", "#    ", "#   #", " ### "),
    "d": ("    #", "    #", " ## #", "#  ##", "#   #", "#   #", " ####"),
    "e": ("     ", "     ", " ### ", "#   #", "#####", "#    ", " ### "),
    "h": ("#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#   #"),
    "i": ("  #  ", "     ", " ##  ", "  #  ", "  #  ", "  #  ", " ### "),
    "l": (" ##  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "),
    "m": ("     ", "     ", "## # ", "# # #", "# # #", "# # #", "#   #"),
    "n": ("     ", "     ", "# ## ", "##  #", "#   #", "#   #", "#   #"),
    "o": ("     ", "     ", " ### ", "#   #", "#   #", "#   #", " ### "),
    "p": ("     ", "     ", "#### ", "#   #", "#### ", "#    ", "#    "),
    "r": ("     ", "     ", "# ## ", "##  #", "#    ", "#    ", "#    "),
    "s": ("     ", "     ", " ####", "#    ", " ### ", "    #", "#### "),
    "t": (" #   ", " #   ", "###  ", " #   ", " #   ", " #  #", "  ## "),
    "u": ("     ", "     ", "#   #", "#   #", "#   #", "#  ##", " ## #"),
    "z": ("     ", "     ", "#####", "   # ", "  #  ", " #   ", "#####"),
}


class Canvas:
    """An RGB image in a bytearray, with just the drawing operations the figure needs."""

    def __init__(self, width: int, height: int, background: Color = WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, color: Color, size: int = 1) -> None:
        for yy in range(y - size // 2, y - size // 2 + size):
            for xx in range(x - size // 2, x - size // 2 + size):
                if 0 <= xx < self.width and 0 <= yy < self.height:
                    i = 3 * (yy * self.width + xx)
                    self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, size: int = 1) -> None:
        """Bresenham's line, each point a ``size``-pixel square."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.dot(x0, y0, color, size)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 2) -> int:
        """Draw ``text`` with its top-left corner at (x, y); return its width in pixels."""
        for k, char in enumerate(text):
            rows = _GLYPHS.get(char)
            for r, row in enumerate(rows or ()):
                for c, bit in enumerate(row):
                    if bit == "#":
                        for yy in range(scale):
                            for xx in range(scale):
                                self.dot(x + 6 * scale * k + c * scale + xx, y + r * scale + yy, color)
        return 6 * scale * len(text)

    def to_png(self) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        stride = 3 * self.width
        # Filter type 0 (none) before every row, as the format requires.
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def nice_ticks(low: float, high: float, count: int = 5, *, cover: bool = False) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) inside [low, high],
    or with ``cover`` from the tick at or below ``low`` to the one at or above ``high``."""
    if not high > low:
        high = low + 1.0
    raw = (high - low) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = (math.floor if cover else math.ceil)(low / step - 1e-9) * step
    last = (math.ceil if cover else math.floor)(high / step + 1e-9) * step
    return [first + i * step for i in range(round((last - first) / step) + 1)]


def _labels(ticks: Sequence[float]) -> list[str]:
    """Tick labels with as many decimals as the tick spacing needs, and no more."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return [f"{t:.{decimals}f}" for t in ticks]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total, queue = [], 0.0, []
    for v in values:
        queue.append(v)
        total += v
        if len(queue) > window:
            total -= queue.pop(0)
        out.append(total / len(queue))
    return out


def draw_loss_png(
    path: str | Path,
    step_x: Sequence[float],
    step_loss: Sequence[float],
    epoch_x: Sequence[float] = (),
    epoch_val_loss: Sequence[float] = (),
    *,
    width: int = 900,
    height: int = 540,
) -> Path:
    """Write the loss figure to ``path``: per-step train loss and per-epoch held-out loss vs step."""
    points = [(x, y) for x, y in zip(step_x, step_loss) if math.isfinite(y)]
    dots = [(x, y) for x, y in zip(epoch_x, epoch_val_loss) if math.isfinite(y)]
    canvas = Canvas(width, height)
    left, right, top, bottom = 90, width - 30, 60, height - 70
    xs = [p[0] for p in points + dots] or [0.0, 1.0]
    ys = [p[1] for p in points + dots] or [0.0, 1.0]
    # The y axis starts and ends on a tick so the lowest loss can be read off it.
    x_ticks, y_ticks = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys), cover=True)
    x_lo, x_hi = min(x_ticks[0], min(xs)), max(x_ticks[-1], max(xs))
    y_lo, y_hi = min(y_ticks[0], min(ys)), max(y_ticks[-1], max(ys))

    def px(x: float) -> int:
        return round(left + (x - x_lo) / ((x_hi - x_lo) or 1.0) * (right - left))

    def py(y: float) -> int:
        return round(bottom - (y - y_lo) / ((y_hi - y_lo) or 1.0) * (bottom - top))

    for t, label in zip(y_ticks, _labels(y_ticks)):
        canvas.line(left, py(t), right, py(t), GRID)
        canvas.text(left - 12 - 12 * len(label), py(t) - 7, label)
    for t, label in zip(x_ticks, _labels(x_ticks)):
        canvas.line(px(t), top, px(t), bottom, GRID)
        canvas.text(px(t) - 6 * len(label), bottom + 10, label)
    canvas.line(left, bottom, right, bottom, BLACK)
    canvas.line(left, top, left, bottom, BLACK)
    canvas.text((left + right) // 2 - 84, height - 32, "optimizer step")
    canvas.text(12, top - 40, "loss")

    # Raw per-step loss is noisy; the moving average carries the trend, as in `trainmesh plot`.
    smoothed = moving_average([p[1] for p in points], max(5, len(points) // 50))
    for series, color, size in ((points, BLUE_FAINT, 1), (list(zip([p[0] for p in points], smoothed)), BLUE, 2)):
        for (x0, y0), (x1, y1) in zip(series, series[1:]):
            canvas.line(px(x0), py(y0), px(x1), py(y1), color, size)
    for (x0, y0), (x1, y1) in zip(dots, dots[1:]):
        canvas.line(px(x0), py(y0), px(x1), py(y1), GREEN, 2)
    for x, y in dots:
        canvas.dot(px(x), py(y), GREEN, 9)

    legend_x = right - 330
    canvas.line(legend_x, top - 38, legend_x + 30, top - 38, BLUE, 3)
    canvas.text(legend_x + 40, top - 45, "train loss (step)")
    canvas.dot(legend_x + 15, top - 14, GREEN, 9)
    canvas.text(legend_x + 40, top - 21, "held-out loss (epoch)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(canvas.to_png())
    return path
