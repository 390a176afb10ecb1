"""What makes a checkpoint directory *complete*: a marker with checksums, written last.

A save writes into ``step_XXXXXXXX.tmp/``; once every rank finished, rank 0 hashes every
file, writes ``COMPLETE.json`` (fsynced), then renames the directory to ``step_XXXXXXXX``
(a single ``rename``, atomic on POSIX file systems) and fsyncs the parent. A crash at any
earlier point leaves a ``.tmp`` directory or a directory without a marker: neither is
ever picked up. ``validate`` re-hashes the files, so truncation or bit rot after the save
is caught too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Any

MARKER = "COMPLETE.json"
# 2: every file loads with torch.load(weights_only=True) (format 1 pickled numpy/Python RNG state).
FORMAT_VERSION = 2
TMP_SUFFIX = ".tmp"
_NAME = re.compile(r"^step_(\d{8,})$")
_CHUNK = 8 << 20


def step_dirname(step: int) -> str:
    if int(step) < 0:
        raise ValueError(f"A checkpoint step must be >= 0. Received: step={step!r}")
    return f"step_{int(step):08d}"


def parse_step(name: str) -> int | None:
    """The step of a final checkpoint directory name, else None (``.tmp`` and strangers)."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_checksums(directory: str) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` of every file under ``directory`` but the marker."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory)
            if rel == MARKER:
                continue
            out[rel] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
    return dict(sorted(out.items()))


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a rename is only durable once its directory is synced)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # some platforms cannot open directories; durability is best effort there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str, payload: dict[str, Any]) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def seal(tmp_dir: str, final_dir: str, info: dict[str, Any]) -> None:
    """Checksum ``tmp_dir``, write the marker LAST, then rename it to ``final_dir`` (rank 0 only)."""
    checksums = file_checksums(tmp_dir)
    for rel in checksums:
        fsync_path(os.path.join(tmp_dir, rel))
    write_json_atomic(os.path.join(tmp_dir, MARKER), {**info, "files": checksums})
    fsync_path(tmp_dir)
    if os.path.exists(final_dir):  # re-saving a step (e.g. after a rollback): the new one wins
        shutil.rmtree(final_dir)
    os.rename(tmp_dir, final_dir)
    fsync_path(os.path.dirname(os.path.abspath(final_dir)))


def read_marker(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, MARKER)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def validate(directory: str, *, checksums: bool = True) -> str | None:
    """None when ``directory`` is a complete, intact checkpoint; else why not, naming the file."""
    marker = read_marker(directory)
    if marker is None:
        return f"{os.path.join(directory, MARKER)} is missing or unreadable"
    for rel, expected in marker.get("files", {}).items():
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            return f"{path} is missing"
        size = os.path.getsize(path)
        if size != expected["size"]:
            return f"{path} has {size} bytes, the marker says {expected['size']} (truncated?)"
        if checksums and sha256_file(path) != expected["sha256"]:
            return f"{path} does not match its sha256 in {MARKER} (corrupted?)"
    return None
