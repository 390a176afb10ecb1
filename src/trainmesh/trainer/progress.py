"""Keras-``fit``-like progress display for one epoch, shown by the main process only.

>>> import io
>>> out = io.StringIO()
>>> bar = ProgressBar(2, epoch=1, epochs=1, stream=out)
>>> bar.update(1, {"loss": 1.5}, samples_per_s=100.0)
>>> bar.update(2, {"loss": 1.25}, samples_per_s=100.0)
>>> bar.close({"loss": 1.25, "skipped": 0})
>>> out.getvalue().splitlines()[-1].endswith("- 100 samples/s - loss: 1.2500 - skipped: 0")
True

On a terminal the bar is drawn by tqdm when it is installed (``pip install 'trainmesh[progress]'``);
otherwise, and whenever the stream is not a TTY (CI logs, files, pipes), it prints plain lines,
one every ``plain_every`` steps, so logs never fill with carriage returns. Every epoch ends
with the same closing line in both modes. The caller decides who shows a bar: the Trainer passes
``enabled=False`` on every rank but the main process.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
from typing import Any, Mapping, TextIO

# Plain mode aims at this many lines per epoch when the epoch length is known.
_PLAIN_LINES_PER_EPOCH = 10
# With an unknown epoch length there is no way to bound the line count; print every this many steps.
_PLAIN_EVERY_UNKNOWN_TOTAL = 100


def format_value(value: Any) -> str:
    """One value the way Keras prints it: ints as ints, floats with 4 decimals (or 4 in exponent form
    when tiny, so a learning rate of 1e-5 does not read as 0.0000), NaN/inf spelled out. Never raises."""
    try:
        if hasattr(value, "item") and callable(value.item):  # 0-d torch tensors and numpy scalars
            value = value.item()
        if isinstance(value, (bool, numbers.Integral)):
            return str(int(value))
        if isinstance(value, numbers.Real):
            value = float(value)
            if not math.isfinite(value):
                return str(value)  # "nan", "inf", "-inf"
            if value != 0.0 and abs(value) < 1e-3:
                return f"{value:.4e}"
            return f"{value:.4f}"
        return str(value)
    except Exception:  # a progress display must never stop training; show *something*
        return repr(value)


def format_duration(seconds: float) -> str:
    """``0.4s``, ``12s``, ``3m05s``, ``2h01m``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_per_step(seconds: float) -> str:
    """Time per step with a unit that keeps 1-3 leading digits: ``1.2s/step``, ``52ms/step``, ``480us/step``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?/step"
    if seconds >= 1:
        return f"{seconds:.1f}s/step"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/step"
    return f"{seconds * 1e6:.0f}us/step"


def format_rate(samples_per_s: float) -> str:
    """``310 samples/s`` (integer from 100 up, one decimal below); NaN/inf shown as such."""
    if not math.isfinite(samples_per_s):
        return f"{samples_per_s} samples/s"
    return f"{samples_per_s:.0f} samples/s" if samples_per_s >= 100 else f"{samples_per_s:.1f} samples/s"


def format_values(values: Mapping[str, Any]) -> str:
    """`` - loss: 0.9237 - val_loss: 0.9001`` in the mapping's order (empty string for no values)."""
    return "".join(f" - {key}: {format_value(value)}" for key, value in values.items())


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:  # closed or exotic streams: treat as a log file
        return False


class ProgressBar:
    """Progress of one epoch: step/total, values, samples/s and ETA.

    Args:
        total: steps in the epoch, or None when the length is unknown (an iterable dataset).
        epoch: 1-based number of this epoch, as printed ("Epoch 2/3"), like ``step``.
        epochs: number of epochs of the run.
        enabled: False prints nothing at all (every rank but the main process).
        stream: where to write; default ``sys.stdout`` at construction time.
        plain_every: in plain mode, print a line every this many steps; default ``ceil(total / 10)``
            (at most ~10 lines per epoch), or 100 when ``total`` is None.
        use_tqdm: None draws with tqdm when it is installed and the stream is a TTY; False forces
            plain lines; True requires tqdm (ImportError otherwise) but still only on a TTY.

    Create it when the epoch begins: the elapsed time on the closing line counts from then.
    """

    def __init__(
        self,
        total: int | None,
        *,
        epoch: int,
        epochs: int,
        enabled: bool = True,
        stream: TextIO | None = None,
        plain_every: int | None = None,
        use_tqdm: bool | None = None,
    ) -> None:
        if total is not None and total < 0:
            raise ValueError(f"total must be >= 0 or None. Received: {total}")
        if epoch < 1 or epochs < 1:
            raise ValueError(
                f"epoch and epochs are 1-based (epoch 1 of 1 is the first). Received: epoch={epoch}, epochs={epochs}"
            )
        if plain_every is not None and plain_every < 1:
            raise ValueError(f"plain_every must be >= 1. Received: {plain_every}")
        self.total = total
        self.enabled = enabled
        self.stream: TextIO = stream if stream is not None else sys.stdout
        self._prefix = f"Epoch {epoch}/{epochs}"
        if plain_every is None:
            plain_every = max(1, math.ceil(total / _PLAIN_LINES_PER_EPOCH)) if total else _PLAIN_EVERY_UNKNOWN_TOTAL
        self.plain_every = plain_every
        self._start = time.perf_counter()
        self._step = 0
        self._rates: list[float] = []
        self._closed = False
        self._tqdm: Any = None
        if enabled and use_tqdm is not False and _is_tty(self.stream):
            self._tqdm = self._make_tqdm(required=use_tqdm is True)

    def _make_tqdm(self, *, required: bool) -> Any:
        try:
            from tqdm import tqdm  # not tqdm.auto: a notebook widget would ignore `stream`
        except ImportError:
            if required:
                raise ImportError("use_tqdm=True needs tqdm: pip install 'trainmesh[progress]'") from None
            return None
        # leave=False: the bar is replaced by the closing line, identical to the plain mode's.
        return tqdm(
            total=self.total, desc=self._prefix, file=self.stream, unit="step", leave=False, dynamic_ncols=False
        )

    @property
    def mode(self) -> str:
        """``"off"``, ``"tqdm"`` or ``"plain"``: how this bar writes."""
        if not self.enabled:
            return "off"
        return "tqdm" if self._tqdm is not None else "plain"

    def update(self, step: int, values: Mapping[str, Any], samples_per_s: float | None = None) -> None:
        """Record that ``step`` (1-based within the epoch) finished with these values."""
        if not self.enabled or self._closed:
            return
        self._step = step
        if samples_per_s is not None:
            try:
                rate = float(samples_per_s)
            except (TypeError, ValueError):
                rate = math.nan
            if math.isfinite(rate):  # one NaN timing must not poison the epoch average
                self._rates.append(rate)
        else:
            rate = None
        if self._tqdm is not None:
            self._update_tqdm(step, values, rate)
        elif step % self.plain_every == 0 and step != self.total:
            # The last step is left to the closing line, which carries the epoch's final numbers.
            self._write(self._plain_line(step, values, rate))

    def _update_tqdm(self, step: int, values: Mapping[str, Any], rate: float | None) -> None:
        try:
            postfix = format_values(values)[3:]  # drop the leading " - "
            if rate is not None:
                postfix = f"{format_rate(rate)} - {postfix}" if postfix else format_rate(rate)
            self._tqdm.set_postfix_str(postfix, refresh=False)
            self._tqdm.update(step - self._tqdm.n)
        except Exception:  # a broken terminal must not stop training: fall back to plain lines
            self._tqdm = None

    def _plain_line(self, step: int, values: Mapping[str, Any], rate: float | None) -> str:
        elapsed = time.perf_counter() - self._start
        parts = [
            f"{self._prefix} {step}/{self.total if self.total is not None else '?'}",
            format_per_step(elapsed / max(step, 1)),
        ]
        if rate is not None:
            parts.append(format_rate(rate))
        if self.total is not None and step < self.total:
            parts.append(f"ETA {format_duration(elapsed / max(step, 1) * (self.total - step))}")
        return " - ".join(parts) + format_values(values)

    def close(self, values: Mapping[str, Any] | None = None) -> None:
        """End the epoch with the closing line, e.g.
        ``Epoch 2/3 8/8 - 0.4s 52ms/step - 310 samples/s - loss: 0.9237 - val_loss: 0.9001``.

        samples/s is ``values["samples_per_s"]`` when given (then not repeated among the values),
        else the mean of the finite rates passed to :meth:`update`. Calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        if self._tqdm is not None:
            try:
                self._tqdm.close()
            except Exception:
                pass
        values = dict(values or {})
        rate = values.pop("samples_per_s", None)
        if rate is None and self._rates:
            rate = sum(self._rates) / len(self._rates)
        elapsed = time.perf_counter() - self._start
        steps = self._step
        total = self.total if self.total is not None else steps
        parts = [
            f"{self._prefix} {steps}/{total}",
            f"{format_duration(elapsed)} {format_per_step(elapsed / max(steps, 1))}",
        ]
        if rate is not None:
            try:
                parts.append(format_rate(float(rate)))
            except (TypeError, ValueError):
                parts.append(f"{rate!r} samples/s")
        self._write(" - ".join(parts) + format_values(values))

    def _write(self, line: str) -> None:
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except Exception:  # e.g. a closed stdout at interpreter shutdown
            pass

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
