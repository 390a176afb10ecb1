"""Reading Hugging Face safetensors checkpoints by byte range: each process reads only what it keeps.

A safetensors file is an 8-byte little-endian header length, a JSON header (``name -> dtype,
shape, data_offsets``) and the raw, row-major tensor bytes. ``WeightFiles.open(path)`` takes a
Hugging Face checkpoint directory (``model.safetensors``, or ``model-0000k-of-0000n.safetensors``
with ``model.safetensors.index.json``) or one ``.safetensors`` file, parses every header and checks
that every tensor's bytes lie inside its file, so a truncated file or an index naming an absent
file is refused before anything is read (and, called before any collective, on every process).

``read_region(name, offsets, shape)`` reads one hyper-rectangle of a tensor (this process's shard of
it) with ``readinto`` / ``preadv`` straight into the destination, never a memory map: pages of a
map count as resident once touched, and a column shard would touch nearly every page of its tensor.
Leading rows are one contiguous range; a column slice of a matrix (a row-wise tensor-parallel
weight) is one read per row. Otherwise (another dtype, more sliced dimensions) whole rows are read
in blocks of at most ``BLOCK_BYTES`` and converted or sliced from there, so the buffer, not the
tensor, bounds the memory in flight.

``fill`` (what loading calls) reads a process's pieces file by file, through one descriptor per
file, in file order, after telling the kernel which ranges are coming (``posix_fadvise``
``SEQUENTIAL`` and ``WILLNEED``): from a cold page cache the disk reads run ahead of the copies,
from a warm one the cost is a few system calls. Each piece is one ``preadv`` at its offset, so
nothing seeks or opens the file again.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
BLOCK_BYTES = 16 << 20  # bytes read at once when whole rows must be read to take a column slice

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class WeightFileError(ValueError):
    """A weights file or directory that cannot be read as stated; the message names the file."""


@dataclass(frozen=True)
class TensorEntry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in ``file``
    nbytes: int


def _read_header(path: str) -> dict[str, TensorEntry]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise WeightFileError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(_MAX_HEADER, size - 8):
            raise WeightFileError(
                f"{path}: truncated or not a safetensors file (header of {header_len} bytes in a file of {size})"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightFileError(f"{path}: unreadable safetensors header ({exc})") from None
    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in _DTYPES:
            raise WeightFileError(
                f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, which trainmesh does "
                f"not read (supported: {sorted(_DTYPES)})"
            )
        dtype, shape = _DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"])
        begin, end = (int(v) for v in info["data_offsets"])
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise WeightFileError(
                f"{path}: tensor {name!r} of shape {list(shape)} {info['dtype']} should take "
                f"{nbytes} bytes; its offsets give {end - begin}"
            )
        if data_start + end > size:
            raise WeightFileError(
                f"{path}: truncated file: tensor {name!r} ends at byte {data_start + end}, the file has {size}"
            )
        entries[name] = TensorEntry(path, dtype, shape, data_start + begin, nbytes)
    return entries


def _files_of(path: str) -> list[str]:
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise WeightFileError(f"weights file {path!r} is not a .safetensors file")
        return [path]
    if not os.path.isdir(path):
        raise WeightFileError(f"no weights at {path!r} (neither a .safetensors file nor a directory)")
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightFileError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.isfile(os.path.join(path, name))]
        if missing:
            raise WeightFileError(f"{index} names {len(missing)} file(s) that are not in {path!r}: {missing[:5]}")
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, SINGLE_NAME)
    if os.path.isfile(single):
        return [single]
    raise WeightFileError(f"{path!r} holds neither {INDEX_NAME} nor {SINGLE_NAME}")


class WeightFiles:
    """The tensors of a safetensors checkpoint, by name; reads regions on demand.

    >>> files = WeightFiles.open("llama-dir")                         # doctest: +SKIP
    >>> files.read_region("lm_head.weight", (0, 0), (16000, 1536))     # doctest: +SKIP
    """

    def __init__(self, entries: dict[str, TensorEntry], source: str):
        self.entries = entries
        self.source = source

    @classmethod
    def open(cls, path: str | os.PathLike) -> "WeightFiles":
        path = os.fspath(path)
        entries: dict[str, TensorEntry] = {}
        for file in _files_of(path):
            for name, entry in _read_header(file).items():
                if name in entries:
                    raise WeightFileError(f"tensor {name!r} is in two files: {entries[name].file} and {file}")
                entries[name] = entry
        return cls(entries, path)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> Iterable[str]:
        return self.entries.keys()

    def fill(self, items: list[tuple[str, torch.Tensor, torch.Tensor, tuple, tuple]]) -> None:
        """Each ``(name, tensor, local piece, its offsets, its shape)``: the piece read from the files."""
        by_file: dict[str, list[tuple[int, int, str, torch.Tensor, tuple, tuple]]] = {}
        for name, _, local, offsets, shape in items:
            entry = self.entries[name]
            start, length = _byte_span(entry, offsets, shape)
            by_file.setdefault(entry.file, []).append((start, length, name, local, offsets, shape))
        for path, pieces in by_file.items():
            pieces.sort(key=lambda piece: piece[0])  # forward through the file
            with open(path, "rb", buffering=0) as f:
                _advise(f.fileno(), [(start, length) for start, length, *_ in pieces])
                for _, _, name, local, offsets, shape in pieces:
                    self.read_region(name, offsets, shape, out=local, fd=f.fileno())

    def read_region(
        self,
        name: str,
        offsets: Sequence[int],
        shape: Sequence[int],
        out: torch.Tensor | None = None,
        fd: int | None = None,
    ) -> torch.Tensor:
        """The block ``[offsets[d] : offsets[d] + shape[d]]`` of tensor ``name``, copied into ``out``
        (converted to its dtype) or returned in the file's dtype; ``fd``: the file, already open."""
        if fd is None:
            with open(self.entries[name].file, "rb", buffering=0) as f:
                return self.read_region(name, offsets, shape, out, f.fileno())
        entry = self.entries[name]
        if len(offsets) != len(entry.shape) or len(shape) != len(entry.shape):
            raise WeightFileError(
                f"{entry.file}: tensor {name!r} has {len(entry.shape)} dims; region "
                f"{list(offsets)} + {list(shape)} has {len(shape)}"
            )
        if out is None:
            out = torch.empty(tuple(shape), dtype=entry.dtype)
        if out.numel() == 0:
            return out
        if not entry.shape:  # a scalar
            out.copy_(self._read(fd, entry, entry.start, entry.nbytes).view(entry.dtype).reshape(()))
            return out
        row_shape, row_numel = entry.shape[1:], math.prod(entry.shape[1:])
        row_bytes = row_numel * entry.dtype.itemsize
        inner = tuple(slice(o, o + s) for o, s in zip(offsets[1:], shape[1:]))
        whole_rows = all(s.start == 0 and s.stop == d for s, d in zip(inner, row_shape))
        in_place = out.dtype == entry.dtype and out.is_contiguous() and out.device.type == "cpu"
        if in_place and whole_rows:  # one range, straight into place
            self._read(
                fd, entry, entry.start + offsets[0] * row_bytes, shape[0] * row_bytes, out.view(-1).view(torch.uint8)
            )
            return out
        if in_place and len(shape) == 2:  # a column slice (row-wise tensor parallel): one read per row
            self._read_columns(fd, entry, offsets, shape, out)
            return out
        rows_per_block = shape[0] if whole_rows else max(1, BLOCK_BYTES // max(row_bytes, 1))
        for first in range(0, shape[0], rows_per_block):
            count = min(rows_per_block, shape[0] - first)
            start = entry.start + (offsets[0] + first) * row_bytes
            block = self._read(fd, entry, start, count * row_bytes).view(entry.dtype).view(count, *row_shape)
            out[first : first + count].copy_(block if whole_rows else block[(slice(None), *inner)])
        return out

    @staticmethod
    def _read_columns(
        fd: int, entry: TensorEntry, offsets: Sequence[int], shape: Sequence[int], out: torch.Tensor
    ) -> None:
        itemsize = entry.dtype.itemsize
        row_bytes, piece = entry.shape[1] * itemsize, shape[1] * itemsize
        dest = memoryview(out.view(-1).view(torch.uint8).numpy())
        for row in range(shape[0]):
            at = entry.start + (offsets[0] + row) * row_bytes + offsets[1] * itemsize
            if os.preadv(fd, [dest[row * piece : (row + 1) * piece]], at) != piece:
                raise WeightFileError(f"{entry.file}: truncated while reading (wanted {piece} bytes at {at})")

    @staticmethod
    def _read(fd: int, entry: TensorEntry, start: int, nbytes: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """``nbytes`` at ``start`` into ``into`` (or a new buffer): ``preadv`` until done, as one
        call may return less (a signal, or reads over 2 GB on Linux)."""
        buffer = torch.empty(nbytes, dtype=torch.uint8) if into is None else into
        view, done = memoryview(buffer.numpy()), 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], start + done)
            if not got:
                raise WeightFileError(f"{entry.file}: truncated while reading (wanted {nbytes} bytes at {start})")
            done += got
        return buffer


def _byte_span(entry: TensorEntry, offsets: Sequence[int], shape: Sequence[int]) -> tuple[int, int]:
    """The bytes of the file a region lies in: from its first row to the end of its last."""
    if not entry.shape:
        return entry.start, entry.nbytes
    row_bytes = math.prod(entry.shape[1:]) * entry.dtype.itemsize
    return entry.start + offsets[0] * row_bytes, shape[0] * row_bytes


def _advise(fd: int, spans: list[tuple[int, int]]) -> None:
    """Tell the kernel the file is read forward and which ranges come next, so its readahead starts
    on all of them at once (from disk); a hint only: where the call is missing, nothing changes."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for start, length in spans:
            if length:
                advise(fd, start, length, os.POSIX_FADV_WILLNEED)
    except OSError:  # a file system that takes no advice
        pass
