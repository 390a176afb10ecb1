"""What a resume finds: the newest valid checkpoint, and every checkpoint it rejected, with why.

Nothing is skipped without a word: a damaged checkpoint, a directory whose ``COMPLETE.json`` is
missing or truncated, and an unfinished save (``.tmp``) are each named in a warning. When
checkpoints exist and none is valid, ``fit(resume=True)`` raises :class:`NoValidCheckpointError`
(listing each one and why) instead of training from step 0; starting over then takes an explicit
``fit(..., on_invalid_checkpoint="start_over")``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from . import integrity
from .single_file import check_checkpoint_file, checksum_path

START_OVER = "start_over"
ON_INVALID = ("raise", START_OVER)


@dataclass(frozen=True)
class Survey:
    chosen: str | None = None
    rejected: tuple[tuple[str, str], ...] = ()  # (path, why), newest first
    unfinished: tuple[str, ...] = ()  # .tmp directories: saves that never committed, not checkpoints

    def warn(self, stacklevel: int = 3) -> None:
        """One warning per rejected checkpoint and per unfinished save (call on one rank)."""
        fallback = f"; resuming from {self.chosen}" if self.chosen else ""
        for path, why in self.rejected:
            warnings.warn(f"Skipping checkpoint {path}: {why}{fallback}.", RuntimeWarning, stacklevel=stacklevel)
        for path in self.unfinished:
            warnings.warn(
                f"Ignoring {path}: a save that never committed (never renamed into place); the next save removes it.",
                RuntimeWarning,
                stacklevel=stacklevel,
            )


class NoValidCheckpointError(RuntimeError):
    """Checkpoints exist and none can be resumed; ``rejected`` lists ``(path, why)``."""

    def __init__(self, location: str, rejected: tuple[tuple[str, str], ...] | list[tuple[str, str]]):
        self.location, self.rejected = location, tuple(rejected)
        lines = "\n".join(f"  - {path}: {why}" for path, why in self.rejected)
        super().__init__(
            f"{len(self.rejected)} checkpoint(s) in {location}, none valid; training did not start (it would have "
            f"begun again at step 0 and lost their progress):\n{lines}\nTo start over anyway, pass "
            f"fit(..., resume=True, on_invalid_checkpoint={START_OVER!r}) (the rejected files are kept, renamed "
            "*.rejected), or move them away."
        )


def check_on_invalid(value: str) -> str:
    if value not in ON_INVALID:
        raise ValueError(
            f"on_invalid_checkpoint must be one of {ON_INVALID}. Received: on_invalid_checkpoint={value!r}"
        )
    return value


def _marker_problem(path: str) -> str | None:
    marker_path = os.path.join(path, integrity.MARKER)
    if not os.path.exists(marker_path):
        return f"{marker_path} is missing (a save that never completed, or a damaged directory)"
    marker = integrity.read_marker(path)
    if marker is None or not isinstance(marker, dict):
        return f"{marker_path} is unreadable or truncated"
    if not isinstance(marker.get("format", 1), int) or not isinstance(marker.get("files"), dict):
        return f"{marker_path} is not a trainmesh checkpoint marker (no format number or file list)"
    if marker.get("format", 1) < integrity.FORMAT_VERSION:
        return (
            f"written in checkpoint format {marker.get('format', 1)} (pickled RNG state, which "
            f"torch.load(weights_only=True) refuses); this trainmesh reads format {integrity.FORMAT_VERSION}"
        )
    return None


def survey_directory(directory: str, *, checksums: bool = True) -> Survey:
    """Sharded checkpoints (``step_XXXXXXXX/``) under ``directory``, newest first. Files are hashed
    only down to the first valid checkpoint; older ones are only checked for their marker."""
    if not os.path.isdir(directory):
        return Survey()
    steps, unfinished = [], []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not os.path.isdir(path):
            continue
        step = integrity.parse_step(name)
        if step is not None:
            steps.append((step, path))
        elif name.endswith(integrity.TMP_SUFFIX):
            if integrity.parse_step(name.removesuffix(integrity.TMP_SUFFIX)) is not None:
                unfinished.append(path)
    chosen, rejected = None, []
    for _, path in sorted(steps, reverse=True):
        problem = _marker_problem(path)
        if problem is None and chosen is None:
            problem = integrity.validate(path, checksums=checksums)
            if problem is None:
                chosen = path
        if problem is not None:
            rejected.append((path, problem))
    return Survey(chosen, tuple(rejected), tuple(sorted(unfinished)))


def survey_files(candidates: list[str]) -> Survey:
    """Single-file checkpoints, newest first (``last.pt``, then ``last.prev.pt``); absent ones are skipped."""
    chosen, rejected = None, []
    for path in candidates:
        if not (os.path.exists(path) or os.path.exists(checksum_path(path))):
            continue
        problem = check_checkpoint_file(path)
        if problem is None:
            chosen = path
            break
        rejected.append((path, problem))
    return Survey(chosen, tuple(rejected))
