"""ProgressBar: plain lines on non-TTY streams, tqdm on a TTY, silence when disabled."""

from __future__ import annotations

import io
import math
import time

import pytest

from trainmesh.trainer.progress import ProgressBar, format_value

pytestmark = pytest.mark.timeout(60)


class FakeTTY(io.StringIO):
    """A stream that claims to be a terminal, as tqdm's target."""

    def isatty(self) -> bool:
        return True


def run_epoch(bar: ProgressBar, steps: int, close_values: dict | None = None) -> None:
    for step in range(1, steps + 1):
        bar.update(step, {"loss": 1.0 / step, "lr": 1e-4}, samples_per_s=310.0)
    bar.close(close_values if close_values is not None else {"loss": 0.92371, "val_loss": 0.9001, "skipped": 1})


def test_plain_mode_prints_about_ten_lines_and_a_keras_closing_line() -> None:
    out = io.StringIO()
    bar = ProgressBar(100, epoch=2, epochs=3, stream=out)
    assert bar.mode == "plain" and bar.plain_every == 10
    run_epoch(bar, 100)
    lines = out.getvalue().splitlines()
    # Steps 10, 20, ..., 90 (step 100 is left to the closing line) + the closing line.
    assert len(lines) == 10
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("Epoch 2/3 10/100 - ")
    assert "ms/step" in lines[0] or "us/step" in lines[0]
    assert "310 samples/s" in lines[0] and "ETA " in lines[0]
    assert lines[0].endswith("loss: 0.1000 - lr: 1.0000e-04")
    closing = lines[-1]
    assert closing.startswith("Epoch 2/3 100/100 - ")
    assert closing.endswith(" - 310 samples/s - loss: 0.9237 - val_loss: 0.9001 - skipped: 1")
    assert "ETA" not in closing


def test_plain_every_and_short_epochs() -> None:
    out = io.StringIO()
    run_epoch(ProgressBar(8, epoch=1, epochs=1, stream=out), 8)
    # ceil(8 / 10) = 1: a line per step but the last, then the closing line.
    assert len(out.getvalue().splitlines()) == 8
    out = io.StringIO()
    run_epoch(ProgressBar(8, epoch=1, epochs=1, stream=out, plain_every=4), 8)
    assert [line.split(" - ")[0] for line in out.getvalue().splitlines()] == ["Epoch 1/1 4/8", "Epoch 1/1 8/8"]


def test_unknown_total() -> None:
    out = io.StringIO()
    bar = ProgressBar(None, epoch=1, epochs=2, stream=out, plain_every=3)
    run_epoch(bar, 7, {"loss": 0.5})
    lines = out.getvalue().splitlines()
    assert [line.split(" - ")[0] for line in lines] == ["Epoch 1/2 3/?", "Epoch 1/2 6/?", "Epoch 1/2 7/7"]
    assert all("ETA" not in line for line in lines)
    # Default for an unknown length: a line every 100 steps.
    assert ProgressBar(None, epoch=1, epochs=1, stream=io.StringIO()).plain_every == 100


def test_closing_rate_from_values_and_stopped_epoch() -> None:
    out = io.StringIO()
    bar = ProgressBar(10, epoch=1, epochs=1, stream=out, plain_every=100)
    bar.update(1, {"loss": 1.0}, samples_per_s=100.0)
    bar.update(2, {"loss": 1.0}, samples_per_s=300.0)
    bar.close({"samples_per_s": 42.0, "loss": 0.5})
    # An epoch stopped early shows how far it got; samples/s from the values is not repeated.
    (line,) = out.getvalue().splitlines()
    assert line.startswith("Epoch 1/1 2/10 - ") and line.endswith(" - 42.0 samples/s - loss: 0.5000")
    bar.close({"loss": 0.1})  # idempotent
    assert out.getvalue() == line + "\n"


def test_nan_and_inf_are_shown_never_raised() -> None:
    out = io.StringIO()
    bar = ProgressBar(2, epoch=1, epochs=1, stream=out, plain_every=1)
    bar.update(1, {"loss": math.nan, "grad_norm": math.inf, "note": object()}, samples_per_s=math.nan)
    bar.update(2, {"loss": -math.inf}, samples_per_s=math.inf)
    bar.close({"loss": math.nan, "val_loss": math.inf, "samples_per_s": math.nan})
    text = out.getvalue()
    assert "loss: nan" in text and "grad_norm: inf" in text and "val_loss: inf" in text
    assert "nan samples/s" in text


def test_format_value() -> None:
    assert format_value(3) == "3"
    assert format_value(True) == "1"
    assert format_value(0.923712) == "0.9237"
    assert format_value(0.0) == "0.0000"
    assert format_value(2.5e-5) == "2.5000e-05"
    assert format_value(float("-inf")) == "-inf"
    torch = pytest.importorskip("torch")
    assert format_value(torch.tensor(0.5)) == "0.5000"
    assert format_value(torch.tensor(7)) == "7"


def test_disabled_prints_nothing() -> None:
    for stream in (io.StringIO(), FakeTTY()):
        bar = ProgressBar(10, epoch=1, epochs=1, enabled=False, stream=stream)
        assert bar.mode == "off"
        run_epoch(bar, 10)
        assert stream.getvalue() == ""


def test_tqdm_on_a_tty() -> None:
    pytest.importorskip("tqdm")
    out = FakeTTY()
    bar = ProgressBar(4, epoch=1, epochs=2, stream=out)
    assert bar.mode == "tqdm"
    for step in range(1, 5):
        time.sleep(0.12)  # past tqdm's 0.1 s refresh interval, so the postfix gets drawn
        bar.update(step, {"loss": 0.5}, samples_per_s=310.0)
    bar.close({"loss": 0.5, "val_loss": 0.25})
    text = out.getvalue()
    assert "\r" in text and "Epoch 1/2" in text
    assert "310 samples/s - loss: 0.5000" in text  # tqdm's postfix
    assert "/4" in text
    # The bar is cleared and replaced by the same closing line as in plain mode.
    last = text.rsplit("\r", 1)[-1]
    assert last.startswith("Epoch 1/2 4/4 - ") and last.endswith("310 samples/s - loss: 0.5000 - val_loss: 0.2500\n")


def test_tqdm_unknown_total_and_forced_plain() -> None:
    pytest.importorskip("tqdm")
    out = FakeTTY()
    bar = ProgressBar(None, epoch=1, epochs=1, stream=out)
    assert bar.mode == "tqdm"
    run_epoch(bar, 3, {"loss": 0.5})
    assert out.getvalue().rsplit("\r", 1)[-1].startswith("Epoch 1/1 3/3 - ")
    assert ProgressBar(3, epoch=1, epochs=1, stream=FakeTTY(), use_tqdm=False).mode == "plain"


def test_tqdm_missing_falls_back_to_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    out = FakeTTY()
    bar = ProgressBar(2, epoch=1, epochs=1, stream=out)
    assert bar.mode == "plain"
    with pytest.raises(ImportError, match="trainmesh\\[progress\\]"):
        ProgressBar(2, epoch=1, epochs=1, stream=FakeTTY(), use_tqdm=True)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="1-based"):
        ProgressBar(3, epoch=0, epochs=3)
    with pytest.raises(ValueError, match="total"):
        ProgressBar(-1, epoch=1, epochs=1)
    with pytest.raises(ValueError, match="plain_every"):
        ProgressBar(3, epoch=1, epochs=1, plain_every=0)


def test_default_stream_is_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    run_epoch(ProgressBar(2, epoch=1, epochs=1), 2, {"loss": 0.5})
    assert capsys.readouterr().out.strip().endswith("loss: 0.5000")
