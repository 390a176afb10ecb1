"""A trainmesh sharded training checkpoint as ``weights=``: its model tensors, read shard by shard.

The checkpoint's DCP metadata gives every tensor's full shape and dtype (read through
``dcp_reader.SafeFileSystemReader``, so nothing in the directory runs code), which is all
``materialize.prepare`` needs to check it against the model before any collective. Filling is
one ``torch.distributed.checkpoint.load`` with ``no_dist=True``: each process hands DCP the
tensors it holds (DTensors as they are), and DCP reads just the chunks overlapping them, from
however many processes wrote the checkpoint, on whatever layout it was written from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

MODEL_PREFIX = "model."  # the Trainer's checkpoints keep the model's state under "model"


@dataclass(frozen=True)
class _Entry:
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class CheckpointWeights:
    """The model tensors of a trainmesh checkpoint, by their ``state_dict`` names."""

    def __init__(self, path: str | os.PathLike):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from trainmesh.checkpoint.hf_export import resolve_checkpoint

        from .dcp_reader import SafeFileSystemReader

        self.source = os.fspath(path)
        self.dcp_dir, _ = resolve_checkpoint(self.source)
        self.reader = SafeFileSystemReader(self.dcp_dir)
        metadata = self.reader.read_metadata()
        self.entries = {
            key[len(MODEL_PREFIX) :]: _Entry(self.dcp_dir, tuple(meta.size), meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
        }

    @staticmethod
    def is_checkpoint(path: str | os.PathLike) -> bool:
        path = os.fspath(path)
        return os.path.isdir(path) and not any(n.endswith(".safetensors") for n in os.listdir(path))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self):
        return self.entries.keys()

    def fill(self, items: list[tuple]) -> None:
        """Load each ``(name in the checkpoint, tensor this process holds, ...)`` in place (a DTensor
        as it is: DCP reads the chunks overlapping its local shard)."""
        import torch.distributed.checkpoint as dcp

        from .dcp_reader import SafeFileSystemReader

        items = [(name, tensor.detach()) for name, tensor, *_ in items]
        mismatched = [(n, t) for n, t in items if t.dtype != self.entries[n].dtype]
        state = {n: t for n, t in items if t.dtype == self.entries[n].dtype}
        # DCP loads into tensors of the stored dtype: a different one goes through a copy
        staged = {n: torch.empty_like(t, dtype=self.entries[n].dtype) for n, t in mismatched}
        dcp.load({"model": {**state, **staged}}, storage_reader=SafeFileSystemReader(self.dcp_dir), no_dist=True)
        with torch.no_grad():
            for name, tensor in mismatched:
                tensor.copy_(staged[name])
