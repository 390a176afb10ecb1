"""Per-step and per-epoch training logs: JSON lines, CSV and (optionally) TensorBoard.

Layout of ``log_dir``::

    steps.jsonl  steps.csv     one record per logged optimizer step
    epochs.jsonl epochs.csv    one record per epoch (train values and val_*)
    tensorboard/               event files, when TensorBoard is used

The JSON lines files are the source of truth (types kept, strict JSON: NaN/inf are written as the
strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, which :func:`read_log` turns back into floats).
The CSV files are for spreadsheets and pandas: NaN/inf are ``nan``/``inf``/``-inf`` (both parse
as floats), a missing value is an empty cell. Every write is flushed, so a crashed run loses at most
the line being written. Only the main process should create a LogWriter.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Literal, Mapping, TextIO

_KINDS = ("steps", "epochs")
# Strict-JSON spellings of the non-finite floats (the tokens Python's json module uses, quoted).
_NONFINITE_TO_JSON = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_JSON_TO_NONFINITE = {v: float(k) for k, v in _NONFINITE_TO_JSON.items()}
# Keys that are the x axis of a record rather than a value to plot in TensorBoard.
_INDEX_KEYS = frozenset({"epoch", "step", "global_step"})


def _plain(value: Any) -> Any:
    """A JSON-able Python value: 0-d tensors and numpy scalars become numbers, NaN/inf strings."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return _NONFINITE_TO_JSON[str(value)]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Real):
        return _plain(float(value))
    return str(value)


def _csv_cell(value: Any) -> str:
    """The CSV text of one (already :func:`_plain`) value."""
    if value is None:
        return ""
    if isinstance(value, str):
        # Undo the JSON spelling: pandas and float() read "nan"/"inf"/"-inf" as floats.
        return str(_JSON_TO_NONFINITE[value]) if value in _JSON_TO_NONFINITE else value
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)  # repr-exact floats; bools as True/False


def _from_json(value: Any) -> Any:
    if isinstance(value, str) and value in _JSON_TO_NONFINITE:
        return _JSON_TO_NONFINITE[value]
    return value


class _CsvFile:
    """An append-only CSV file whose header is the union of all keys seen so far.

    A record with a new key rewrites the file once with the wider header (existing rows get empty
    cells in the new columns). The rewrite goes to a temporary file that replaces the old one
    atomically, so a crash during it leaves the old, complete file. New keys are rare (val_* on the
    first eval, loss_scale after a switch), so the O(file) rewrite is paid a handful of times per run.
    """

    def __init__(self, path: Path, *, append: bool) -> None:
        self.path = path
        self.columns: list[str] = []
        if append and path.exists() and path.stat().st_size > 0:
            with path.open(newline="") as f:
                self.columns = next(csv.reader(f), [])
        self._file: TextIO = path.open("a" if append else "w", newline="")

    def write(self, record: Mapping[str, Any]) -> None:
        new = [key for key in record if key not in self.columns]
        if new:
            self._widen(new)
        csv.writer(self._file).writerow([_csv_cell(record.get(col)) for col in self.columns])
        self._file.flush()

    def _widen(self, new_columns: list[str]) -> None:
        old_columns = self.columns
        self.columns = old_columns + new_columns
        self._file.close()
        rows: list[list[str]] = []
        if old_columns and self.path.exists():
            with self.path.open(newline="") as f:
                rows = list(csv.reader(f))[1:]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self.columns)
            pad = [""] * len(new_columns)
            writer.writerows(row + pad for row in rows)
        os.replace(tmp, self.path)
        self._file = self.path.open("a", newline="")

    def close(self) -> None:
        self._file.close()


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can be used (the ``tensorboard`` package is installed)."""
    return importlib.util.find_spec("tensorboard") is not None


class LogWriter:
    """Writes step and epoch records under ``log_dir`` (created if missing).

    Args:
        log_dir: directory of the logs.
        tensorboard: True writes TensorBoard events (ImportError when tensorboard is missing),
            False never does, None (default) does when tensorboard is installed.
        append: False (default) starts the four files afresh; True continues them (a resumed run).

    Records are flat dicts; every key becomes a column. Step records are drawn in TensorBoard at
    ``record["global_step"]`` and epoch records at ``record["epoch"]`` (a running count when absent),
    as ``step/<key>`` and ``epoch/<key>`` for each numeric key.
    """

    def __init__(
        self, log_dir: str | os.PathLike[str], *, tensorboard: bool | None = None, append: bool = False
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = {kind: (self.log_dir / f"{kind}.jsonl").open("a" if append else "w") for kind in _KINDS}
        self._csv = {kind: _CsvFile(self.log_dir / f"{kind}.csv", append=append) for kind in _KINDS}
        self._counts = {kind: 0 for kind in _KINDS}
        self._closed = False
        self.tensorboard_dir: Path | None = None
        self._tb: Any = None
        if tensorboard is None:
            tensorboard = tensorboard_available()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                self.close()
                raise ImportError("tensorboard=True needs TensorBoard: pip install 'trainmesh[tensorboard]'") from exc
            self.tensorboard_dir = self.log_dir / "tensorboard"
            self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir))

    def log_step(self, record: Mapping[str, Any]) -> None:
        """Append one step record (TensorBoard x: ``global_step``)."""
        self._log("steps", record, "global_step")

    def log_epoch(self, record: Mapping[str, Any]) -> None:
        """Append one epoch record (TensorBoard x: ``epoch``)."""
        self._log("epochs", record, "epoch")

    def _log(self, kind: str, record: Mapping[str, Any], x_key: str) -> None:
        if self._closed:
            raise ValueError(f"LogWriter for {self.log_dir} is closed")
        plain = {str(key): _plain(value) for key, value in record.items()}
        self._jsonl[kind].write(json.dumps(plain, allow_nan=False) + "\n")
        self._jsonl[kind].flush()
        self._csv[kind].write(plain)
        x = self._counts[kind]
        self._counts[kind] += 1
        if self._tb is not None:
            x_value = plain.get(x_key)
            if isinstance(x_value, int) and not isinstance(x_value, bool):
                x = x_value
            self._scalars(kind[:-1], record, x)

    def _scalars(self, prefix: str, record: Mapping[str, Any], x: int) -> None:
        for key, value in record.items():
            if key in _INDEX_KEYS or isinstance(value, bool):
                continue
            if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
                value = value.item()
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                # NaN/inf go in as they are: TensorBoard shows them, which is what one wants to see.
                self._tb.add_scalar(f"{prefix}/{key}", float(value), global_step=x)
        self._tb.flush()

    def close(self) -> None:
        """Close every file; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        for f in getattr(self, "_jsonl", {}).values():
            f.close()
        for c in getattr(self, "_csv", {}).values():
            c.close()
        if getattr(self, "_tb", None) is not None:
            self._tb.close()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_log(log_dir: str | os.PathLike[str], kind: Literal["steps", "epochs"] = "steps") -> list[dict[str, Any]]:
    """The records of ``log_dir/<kind>.jsonl`` as dicts, NaN/inf restored as floats.

    A last line cut short by a crash is skipped; a bad line elsewhere raises ValueError.
    FileNotFoundError when the file does not exist.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}. Received: {kind!r}")
    path = Path(log_dir) / f"{kind}.jsonl"
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON record: {exc}") from None
        records.append({key: _from_json(value) for key, value in record.items()})
    return records
