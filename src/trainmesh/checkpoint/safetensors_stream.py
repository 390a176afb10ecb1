"""The safetensors bytes of one planned file, written one tensor at a time.

Why a streaming writer rather than ``safetensors.torch.save_file``: ``save_file`` takes every
tensor of a file at once, so a writer would hold a whole output file (with the default 5 GB
shards, often the whole model). The safetensors layout is fixed by the shapes alone (an 8-byte
header length, a JSON header of dtypes, shapes and byte offsets, then the raw little-endian
bytes), so the header is written first and each tensor as it arrives, then dropped.
Readers check the result: transformers and ``safetensors.safe_open`` load these files.

It exists apart from ``hf_layout.py`` (staging and commit) and ``hf_file_plan.py`` (which tensor
goes in which file) because it is the format alone: the collective save's direct writes
(``hf_save_direct``) use its header without its writer.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from .hf_file_plan import Entry, FilePlan

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
