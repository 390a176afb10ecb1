"""Which complete checkpoints exist, which is best, and which to delete (keep last k + best)."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from typing import Any

from .integrity import TMP_SUFFIX, parse_step, read_marker


@dataclass(frozen=True)
class Entry:
    step: int
    path: str
    marker: dict[str, Any]


def resolve_keep_best(keep_best: Any) -> tuple[str, str] | None:
    if keep_best is None:
        return None
    if not (isinstance(keep_best, (tuple, list)) and len(keep_best) == 2 and keep_best[1] in ("min", "max")):
        raise ValueError(f"keep_best must be None or (metric, 'min' | 'max'). Received: keep_best={keep_best!r}")
    return str(keep_best[0]), str(keep_best[1])


def complete_entries(directory: str) -> list[Entry]:
    """Final-named directories that carry a marker, oldest first (no checksum pass: that is ``latest``'s)."""
    if not os.path.isdir(directory):
        return []
    entries = []
    for name in os.listdir(directory):
        step = parse_step(name)
        path = os.path.join(directory, name)
        if step is None or not os.path.isdir(path):
            continue
        marker = read_marker(path)
        if marker is not None:
            entries.append(Entry(step, path, marker))
    return sorted(entries, key=lambda e: e.step)


def best_entry(entries: list[Entry], keep_best: tuple[str, str] | None) -> Entry | None:
    if keep_best is None:
        return None
    metric, mode = keep_best
    scored = [
        (float(e.marker.get("metrics", {})[metric]), e)
        for e in entries
        if isinstance(e.marker.get("metrics"), dict) and metric in e.marker["metrics"]
    ]
    scored = [(v, e) for v, e in scored if math.isfinite(v)]
    if not scored:
        return None
    # Ties go to the newer checkpoint: same quality, more training.
    if mode == "min":
        return min(scored, key=lambda ve: (ve[0], -ve[1].step))[1]
    return max(scored, key=lambda ve: (ve[0], ve[1].step))[1]


def prune(directory: str, keep_last: int, keep_best: tuple[str, str] | None) -> list[str]:
    """Delete complete checkpoints outside (newest ``keep_last``) + best; return the deleted paths."""
    entries = complete_entries(directory)
    keep = {e.path for e in entries[-keep_last:]} if keep_last > 0 else set()
    best = best_entry(entries, keep_best)
    if best is not None:
        keep.add(best.path)
    deleted = []
    for entry in entries:
        if entry.path not in keep:
            shutil.rmtree(entry.path, ignore_errors=True)
            deleted.append(entry.path)
    return deleted


def remove_partial(directory: str) -> list[str]:
    """Delete ``.tmp`` leftovers of saves that never committed (a crash, a kill)."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        if name.endswith(TMP_SUFFIX) and parse_step(name[: -len(TMP_SUFFIX)]) is not None:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed.append(os.path.join(directory, name))
    return removed
