"""The Hugging Face checkpoint layout, written one tensor at a time and published atomically.

The pieces :func:`trainmesh.save_pretrained` (collective) and ``trainmesh export`` (offline)
share: the file plan (transformers' greedy split by ``max_shard_size``, file names and index),
a streaming safetensors writer, the choice of which name a tied weight is written under, the
model's ``config.json`` / ``generation_config.json``, and the commit. This module is the commit
(staging, index, publishing); the other pieces live in ``hf_file_plan`` (the plan),
``safetensors_stream`` (the writer), ``hf_ties`` (tied names) and ``hf_configs`` (the configs),
and are re-exported here, the path callers import them from.

Atomicity: every file is written (and fsynced) in a staging folder inside the output folder.
The commit first removes the old checkpoint's entry point (``model.safetensors.index.json`` or
``model.safetensors``), moves shards and configs into place, and renames the new entry point
last. A crash at any moment leaves either the previous checkpoint untouched (before the commit)
or a folder without an entry point, which ``from_pretrained`` refuses.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from .hf_configs import configs_of, find_pretrained, main_dtype, save_configs
from .hf_file_plan import INDEX_NAME, WEIGHTS_NAME, Entry, FilePlan, index_json, parse_size, plan_files
from .hf_ties import kept_name, merge_groups, tie_groups_of, tied_target_patterns
from .integrity import fsync_path
from .safetensors_stream import SafetensorsWriter, header_bytes, write_file

__all__ = [
    "INDEX_NAME",
    "STAGING_NAME",
    "WEIGHTS_NAME",
    "Entry",
    "FilePlan",
    "SafetensorsWriter",
    "commit",
    "configs_of",
    "find_pretrained",
    "header_bytes",
    "index_json",
    "kept_name",
    "main_dtype",
    "merge_groups",
    "parse_size",
    "plan_files",
    "prepare_staging",
    "publish",
    "save_configs",
    "tie_groups_of",
    "tied_target_patterns",
    "write_file",
    "write_index",
]

STAGING_NAME = ".trainmesh-save.partial"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def prepare_staging(directory: str) -> str:
    """A fresh, empty staging folder inside ``directory`` (a crashed save's one is removed)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"save_pretrained writes a folder; {directory!r} is a file.")
    staging = os.path.join(directory, STAGING_NAME)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def write_index(staging: str, files: list[FilePlan]) -> None:
    if len(files) > 1:
        path = os.path.join(staging, INDEX_NAME)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(index_json(files), indent=2, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def commit(staging: str, directory: str, files: list[FilePlan], extra: list[str]) -> None:
    """Publish the staged checkpoint: the old entry point goes first, the new one comes last."""
    entry_point = INDEX_NAME if len(files) > 1 else WEIGHTS_NAME
    for old in (INDEX_NAME, WEIGHTS_NAME):
        if os.path.exists(os.path.join(directory, old)):
            os.remove(os.path.join(directory, old))
    fsync_path(directory)  # from here on the folder holds no loadable checkpoint until the last rename
    new_names = {f.filename for f in files}
    for name in os.listdir(directory):
        if _SHARD_NAME.match(name) and name not in new_names:
            os.remove(os.path.join(directory, name))  # a previous save's extra shards
    for name in [f.filename for f in files if f.filename != entry_point] + extra:
        publish(staging, directory, name)
    fsync_path(directory)
    publish(staging, directory, entry_point)
    fsync_path(directory)
    shutil.rmtree(staging, ignore_errors=True)


def publish(staging: str, directory: str, name: str) -> None:
    """Move one staged file into place (a module-level step so tests can fail it)."""
    os.replace(os.path.join(staging, name), os.path.join(directory, name))
