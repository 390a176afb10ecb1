"""A ``torch.distributed.checkpoint`` reader that runs no code from the checkpoint.

torch's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with a plain ``pickle.load`` and
hands non-tensor items to the planner, which reads them with ``torch.load(weights_only=False)``
(torch 2.14): a crafted checkpoint directory could run code at load. This reader unpickles the
metadata with an allowlist (DCP's own metadata dataclasses, torch sizes, dtypes and layouts,
paths) and reads every non-tensor item with ``torch.load(weights_only=True)`` before the planner
sees it (re-serialised from the safe objects, so any planner works unchanged). Tensors were
already read with ``weights_only=True`` by torch.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

# Modules whose dataclasses and enums make up DCP's metadata (nothing callable with effects).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PLAIN = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asks to build an object that could run code; nothing was built."""


def refusal_detail(exc: BaseException) -> str:
    """The line of torch's weights_only refusal that says what was refused (not its advice to trust the file)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next(
        (line for line in lines if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line),
        lines[0] if lines else type(exc).__name__,
    )


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return _PLAIN[(module, name)]
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        if module in _METADATA_MODULES:
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise UnsafeCheckpointError(
            f"{self.path} asks to build {module}.{name}, which is not part of a checkpoint's metadata; "
            "trainmesh refuses to run code from a checkpoint. Received: a checkpoint that is damaged or "
            "not written by torch.distributed.checkpoint"
        )


class _SafeBytes:
    """The planner, except that non-tensor items are read with ``weights_only=True`` first."""

    def __init__(self, planner, path: str):
        self._planner = planner
        self._path = path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"{self._path}: item {read_item.dest_index.fqn!r} holds objects that torch.load(weights_only=True) "
                f"refuses; trainmesh refuses to run code from a checkpoint ({refusal_detail(exc)})"
            ) from None
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        self._planner.load_bytes(read_item, safe)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` with an allowlisted metadata unpickler and ``weights_only`` non-tensor items."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file, str(path)).load()
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} does not hold DCP metadata. Received: {type(metadata).__name__}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, _SafeBytes(planner, str(self.path)))
