"""The file plan of a Hugging Face checkpoint: which tensor goes in which file, the file names and
the index, as transformers' ``save_pretrained`` lays them out (its greedy split by ``max_shard_size``).

It exists apart from ``hf_layout.py`` (staging and commit) and ``safetensors_stream.py`` (the
bytes) because it is pure arithmetic on names, shapes and dtypes: every process of a collective
save computes the same plan without touching a tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .safetensors_stream import _DTYPES, _WRITE_ORDER

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string as transformers reads it ("5GB" = 5e9, "2GiB" = 2**31)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper()) if isinstance(size, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"max_shard_size must be a positive number of bytes or a string such as '5GB' or '500MiB'. "
            f"Received: max_shard_size={size!r}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2) or "B"])


@dataclass
class Entry:
    """One tensor of the output: its name, full shape and the dtype it is written in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool = True
    position: int = 0  # order in the model's state dict

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class FilePlan:
    """One output file: its name and its tensors in the order their bytes follow each other."""

    filename: str
    entries: list[Entry] = field(default_factory=list)
    writer: int = 0  # the process that writes it (collective saves)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def plan_files(entries: list[Entry], max_bytes: int) -> list[FilePlan]:
    """transformers' split (huggingface_hub's): in state-dict order, a new file when the next tensor
    would tip the current one over ``max_bytes``; a tensor larger than that gets a file of its own,
    numbered where it comes, while the current file keeps filling."""
    for entry in entries:
        if entry.dtype not in _DTYPES:  # checked before any tensor moves
            raise ValueError(f"safetensors cannot store {entry.name!r} of dtype {entry.dtype}.")
    groups: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for entry in sorted(entries, key=lambda e: e.position):
        if entry.nbytes > max_bytes:  # as huggingface_hub splits: a file of its own, the current one goes on
            groups.append([entry])
            continue
        if current and size + entry.nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current or not groups:
        groups.append(current)
    names = (
        [WEIGHTS_NAME]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    # safetensors' own order (what transformers' save_pretrained writes, byte for byte): its dtypes
    # widest first (every tensor starts aligned to its element size), then by name.
    return [
        FilePlan(name, sorted(group, key=lambda e: (_WRITE_ORDER.index(e.dtype), e.name)))
        for name, group in zip(names, groups)
    ]


def index_json(files: list[FilePlan]) -> dict[str, Any]:
    """The ``model.safetensors.index.json`` of a sharded plan (transformers' fields)."""
    total_parameters = sum(e.numel for f in files for e in f.entries if e.is_param)
    return {
        "metadata": {"total_parameters": total_parameters, "total_size": sum(f.nbytes for f in files)},
        "weight_map": {e.name: f.filename for f in files for e in f.entries},
    }
