"""Files trainmesh writes with ``torch.save``: fsynced, checked to load with ``weights_only=True``, and,
for whole checkpoints (``ModelCheckpoint``'s ``last.pt`` / ``best.pt``), checksummed and atomic.

Beside ``last.pt`` lies ``last.pt.sha256`` in ``sha256sum`` format (``sha256sum -c last.pt.sha256``
checks it by hand). Saving ``last.pt`` again first keeps the current one as ``last.prev.pt`` (hard
links, so both match their checksums at every instant), then moves the new checksum and then the
new file into place. A crash at any point leaves at least one file that matches its checksum, and
a reader that finds ``last.pt`` damaged falls back to ``last.prev.pt``.

>>> save_checkpoint_file({"step": 3, "w": torch.zeros(2)}, "ckpt/last.pt")   # doctest: +SKIP
>>> check_checkpoint_file("ckpt/last.pt") is None                          # doctest: +SKIP
True
"""

from __future__ import annotations

import os
import pickle
import shutil
from typing import Any

import torch

from .._torch.dcp_reader import refusal_detail
from .integrity import fsync_path, sha256_file

CHECKSUM_SUFFIX = ".sha256"
SAFE_LOADING = "trainmesh reads checkpoints with torch.load(weights_only=True), which runs no code from the file"


def checksum_path(path: str) -> str:
    return path + CHECKSUM_SUFFIX


def previous_path(path: str) -> str:
    """``last.pt`` -> ``last.prev.pt``: the generation kept when ``last.pt`` is saved again."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.prev{ext}"


def save_plain(obj: Any, path: str, *, what: str) -> None:
    """``torch.save`` + fsync, refusing (and removing the file) when it would not load with
    ``weights_only=True``: ``what`` names the object in the error (say, ``"per-rank extras"``)."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    if unsafe:
        os.remove(path)
        raise TypeError(
            f"The {what} hold objects that torch.load(weights_only=True) cannot rebuild: {unsafe}. "
            f"{SAFE_LOADING}; keep checkpoint state to tensors and plain Python values. "
            f"Received: {', '.join(unsafe)} in the {what}"
        )


def load_plain(path: str) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; a file that asks for more names itself."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(
            f"{path} holds objects that weights_only=True refuses ({refusal_detail(exc)}). "
            f"{SAFE_LOADING}; a file that needs more may run code, and is not "
            "loaded"
        ) from None


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links: a real copy, made durable
        shutil.copyfile(source, target)
        fsync_path(target)


def _remove(*paths: str) -> None:
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def save_checkpoint_file(state: dict[str, Any], path: str | os.PathLike, *, keep_previous: bool = True) -> str:
    """Write ``state`` to ``path`` with its checksum file, keeping the current one as
    :func:`previous_path` first (``keep_previous``). Returns ``path``."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp, tmp_sum = f"{path}.part", f"{checksum_path(path)}.part"
    save_plain(state, tmp, what=f"checkpoint state for {path}")
    with open(tmp_sum, "w") as fh:
        fh.write(f"{sha256_file(tmp)}  {os.path.basename(path)}\n")
        fh.flush()
        os.fsync(fh.fileno())
    if keep_previous and os.path.isfile(path) and os.path.isfile(checksum_path(path)):
        prev = previous_path(path)
        _remove(checksum_path(prev), prev)  # the checksum first: never a stale one beside a new file
        _link_or_copy(path, prev)
        with open(checksum_path(path)) as fh:
            digest = fh.read().split()[0]
        with open(f"{checksum_path(prev)}.part", "w") as fh:
            fh.write(f"{digest}  {os.path.basename(prev)}\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(f"{checksum_path(prev)}.part", checksum_path(prev))
    # The new checksum first, then the file: in between, ``path`` fails its check and the
    # previous generation is the one a reader takes.
    os.replace(tmp_sum, checksum_path(path))
    os.replace(tmp, path)
    fsync_path(directory)
    return path


def check_checkpoint_file(path: str | os.PathLike) -> str | None:
    """None when ``path`` matches its checksum file; else what is wrong, naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return f"{path} is missing"
    try:
        with open(checksum_path(path)) as fh:
            recorded = fh.read().split()
    except OSError:
        return (
            f"{checksum_path(path)} is missing: {path} cannot be checked (an interrupted save, or a file "
            "not written by trainmesh)"
        )
    if not recorded or len(recorded[0]) != 64:
        return f"{checksum_path(path)} is unreadable or truncated"
    if sha256_file(path) != recorded[0]:
        return (
            f"{path} does not match its sha256 in {os.path.basename(checksum_path(path))} "
            f"(corrupted or truncated; {os.path.getsize(path)} bytes)"
        )
    return None


def set_aside(path: str) -> list[str]:
    """Rename ``path`` and its checksum file to ``*.rejected`` (a fresh start keeps the evidence)."""
    moved = []
    for name in (path, checksum_path(path)):
        if os.path.exists(name):
            os.replace(name, name + ".rejected")
            moved.append(name + ".rejected")
    return moved
