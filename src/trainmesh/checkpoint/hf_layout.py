"""The Hugging Face checkpoint layout, written one tensor at a time and published atomically.

The pieces :func:`trainmesh.save_pretrained` (collective) and ``trainmesh export`` (offline)
share: the file plan (transformers' greedy split by ``max_shard_size``, file names and index),
a streaming safetensors writer, the choice of which name a tied weight is written under, the
model's ``config.json`` / ``generation_config.json``, and the commit.

Why a streaming writer rather than ``safetensors.torch.save_file``: ``save_file`` takes every
tensor of a file at once, so a writer would hold a whole output file (with the default 5 GB
shards, often the whole model). The safetensors layout is fixed by the shapes alone (an 8-byte
header length, a JSON header of dtypes, shapes and byte offsets, then the raw little-endian
bytes), so the header is written first and each tensor as it arrives, then dropped.
Readers check the result: transformers and ``safetensors.safe_open`` load these files.

Atomicity: every file is written (and fsynced) in a staging folder inside the output folder.
The commit first removes the old checkpoint's entry point (``model.safetensors.index.json`` or
``model.safetensors``), moves shards and configs into place, and renames the new entry point
last. A crash at any moment leaves either the previous checkpoint untouched (before the commit)
or a folder without an entry point, which ``from_pretrained`` refuses.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .integrity import fsync_path

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
STAGING_NAME = ".trainmesh-save.partial"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
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
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}

# safetensors' Dtype enum, last first: the order its writer lays tensors out in (read off save_file)
_WRITE_ORDER = [
    torch.uint64,
    torch.int64,
    torch.float64,
    torch.float32,
    torch.uint32,
    torch.int32,
    torch.bfloat16,
    torch.float16,
    torch.uint16,
    torch.int16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.bool,
]


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


def header_bytes(plan: FilePlan, metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (the header's length, then its JSON, padded so the data starts 8-byte
    aligned) and each tensor's byte offset in the file: fixed by names, shapes and dtypes alone."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offsets, offset = {}, 0
    for entry in plan.entries:
        header[entry.name] = {
            "dtype": _DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offsets[entry.name] = offset
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return head, {name: len(head) + at for name, at in offsets.items()}


class SafetensorsWriter:
    """Writes one planned file: the header at once, then each tensor, in plan order, as it comes."""

    def __init__(self, path: str, plan: FilePlan, metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":  # safetensors stores little-endian bytes; we write memory as is
            raise RuntimeError("Writing safetensors needs a little-endian machine.")
        self.path, self.plan, self._next, self._done = path, plan, 0, 0  # entry, elements of it written
        self._file = open(path, "wb")
        self._file.write(header_bytes(plan, metadata)[0])
        self._skip_empty()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``: the whole of ``name``, or its next piece in row-major order."""
        if tensor.numel() == 0:
            return  # nothing to place (empty tensors are passed over by _skip_empty)
        entry = self.plan.entries[self._next] if self._next < len(self.plan.entries) else None
        numel = tensor.numel()
        if entry is None or name != entry.name or tensor.dtype != entry.dtype or self._done + numel > entry.numel:
            raise ValueError(
                f"{self.path}: expected {entry.name if entry else 'nothing'!r} "
                f"({entry.dtype if entry else ''}), got {name!r} {tuple(tensor.shape)} {tensor.dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._done += numel
        if self._done == entry.numel:
            self._next, self._done = self._next + 1, 0
            self._skip_empty()

    def _skip_empty(self) -> None:
        while self._next < len(self.plan.entries) and self.plan.entries[self._next].numel == 0:
            self._next += 1

    def close(self, *, sync: bool = True) -> None:
        """Flush and close; ``sync=False`` leaves the fsync to the caller (``fsync_path``), which
        may run it beside other work: fsync acts on the file, not on this handle."""
        if self._next != len(self.plan.entries):
            self.abort()
            raise RuntimeError(f"{self.path}: {len(self.plan.entries) - self._next} tensor(s) never arrived.")
        self._file.flush()
        if sync:
            os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        self._file.close()


def write_file(path: str, plan: FilePlan, fetch: Callable[[Entry], torch.Tensor]) -> None:
    """Write ``plan`` to ``path`` with ``fetch(entry)`` giving each full tensor (one held at a time)."""
    writer = SafetensorsWriter(path, plan)
    try:
        for entry in plan.entries:
            tensor = fetch(entry)
            if tuple(tensor.shape) != entry.shape:
                raise ValueError(f"{entry.name!r}: expected shape {entry.shape}, got {tuple(tensor.shape)}")
            writer.write(entry.name, tensor.to(entry.dtype))
    except BaseException:
        writer.abort()
        raise
    writer.close()


# --- which name a tied weight is written under ----------------------------------------------------


def tied_target_patterns(model: nn.Module | None) -> list[str]:
    """The names transformers re-ties on load (``_tied_weights_keys`` of every submodule)."""
    patterns: list[str] = []
    for name, module in model.named_modules() if model is not None else ():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        patterns += [f"{name}.{key}" if name else key for key in tied]  # a dict (v5) or a list: its keys
    return patterns


def tie_groups_of(module: nn.Module, names: Iterable[str]) -> list[list[str]]:
    """Groups of ``names`` that are one parameter or buffer of ``module`` under several names."""
    wanted, by_id = set(names), {}
    tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        if name in wanted:
            by_id.setdefault(id(tensor), []).append(name)
    return [group for group in by_id.values() if len(group) > 1]


def merge_groups(groups: Iterable[Iterable[str]]) -> list[set[str]]:
    """Union of overlapping name groups (ties seen by different processes)."""
    merged: list[set[str]] = []
    for group in groups:
        group = set(group)
        overlapping = [m for m in merged if m & group]
        for m in overlapping:
            group |= m
            merged.remove(m)
        merged.append(group)
    return merged


def kept_name(group: set[str], patterns: list[str], order: dict[str, int]) -> str:
    """transformers' rule: drop the names matching a tied-weights pattern, keep the first of the rest."""
    ordered = sorted(group, key=lambda n: (order.get(n, len(order)), n))
    free = [n for n in ordered if not any(re.search(p, n) for p in patterns)]
    return (free or ordered)[0]


# --- config.json and generation_config.json ----------------------------------------------------


def find_pretrained(model: nn.Module | None) -> nn.Module | None:
    """The transformers model in ``model`` or under its wrappers (DDP, compile, peft), if any."""
    queue, seen = [model], set()
    while queue:
        module = queue.pop(0)
        if not isinstance(module, nn.Module) or id(module) in seen:
            continue
        seen.add(id(module))
        config = vars(module).get("config")
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            return module
        queue += [vars(module).get("_modules", {}).get(a) for a in ("module", "_orig_mod", "base_model", "model")]
    return None


def configs_of(pretrained: nn.Module | None) -> tuple[Any, Any, str | None]:
    """(config, generation_config, architecture name) of a transformers model, or Nones."""
    if pretrained is None:
        return None, None, None
    can_generate = getattr(pretrained, "can_generate", lambda: True)()
    generation_config = getattr(pretrained, "generation_config", None) if can_generate else None
    return vars(pretrained).get("config"), generation_config, type(pretrained).__name__.removeprefix("FSDP")


def save_configs(
    directory: str,
    config: Any,
    generation_config: Any = None,
    architecture: str | None = None,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write ``config.json`` (+ ``generation_config.json``) as transformers' ``save_pretrained`` does."""
    if config is None:
        return []
    config = copy.deepcopy(config)
    if architecture is not None:
        config.architectures = [architecture]
    if dtype is not None:
        config.dtype = str(dtype).split(".")[-1]
    config.save_pretrained(directory)
    written = ["config.json"]
    if generation_config is not None and callable(getattr(generation_config, "save_pretrained", None)):
        generation_config.save_pretrained(directory)
        written.append("generation_config.json")
    for name in written:
        fsync_path(os.path.join(directory, name))
    return written


def main_dtype(entries: list[Entry]) -> torch.dtype | None:
    """The floating dtype holding the most bytes (what ``config.dtype`` records)."""
    sizes: dict[torch.dtype, int] = {}
    for entry in entries:
        if entry.dtype.is_floating_point:
            sizes[entry.dtype] = sizes.get(entry.dtype, 0) + entry.nbytes
    return max(sizes, key=sizes.get) if sizes else None


# --- staging and commit ---------------------------------------------------------------------------


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
