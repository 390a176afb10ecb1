"""Distributed input: global batches split over replicas, and per-replica input pipelines.

``experimental_distribute_dataset`` follows TF's ``AutoShardPolicy.DATA`` on one replica per
process: every process iterates the *same* global batches and keeps its contiguous slice of
each. A global batch of ``B`` samples over ``N`` replicas gives the first ``B % N`` replicas
``B // N + 1`` samples and the others ``B // N`` (TF's ``batch_sizes_for_worker``: sizes
differ by at most one), so a final partial batch can leave a replica with an empty slice;
that replica still takes the step (its loss is 0, its gradient zeros), which keeps every
collective in lock-step. Loss scaling by the *global* batch size keeps this exact.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch


class InputContext:
    """What an input function needs to know (TF ``tf.distribute.InputContext``).

    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2)
    >>> ctx.get_per_replica_batch_size(128)
    64
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        for name, value, low in (
            ("num_input_pipelines", num_input_pipelines, 1),
            ("input_pipeline_id", input_pipeline_id, 0),
            ("num_replicas_in_sync", num_replicas_in_sync, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}. Received: {name}={value!r}")
        if input_pipeline_id >= num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id must be in [0, num_input_pipelines={num_input_pipelines}). "
                f"Received: input_pipeline_id={input_pipeline_id}"
            )
        self._num_input_pipelines = int(num_input_pipelines)
        self._input_pipeline_id = int(input_pipeline_id)
        self._num_replicas_in_sync = int(num_replicas_in_sync)

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``; ValueError unless it divides evenly."""
        if (
            isinstance(global_batch_size, bool)
            or not isinstance(global_batch_size, (int, np.integer))
            or global_batch_size < 1
            or global_batch_size % self._num_replicas_in_sync
        ):
            raise ValueError(
                f"The global batch size must be a positive multiple of num_replicas_in_sync "
                f"({self._num_replicas_in_sync}). Received: global_batch_size={global_batch_size!r}"
            )
        return int(global_batch_size) // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, num_replicas_in_sync={self._num_replicas_in_sync})"
        )


def replica_bounds(batch_size: int, num_replicas: int, replica_id: int) -> tuple[int, int]:
    """``[start, stop)`` of replica ``replica_id``'s contiguous slice of a batch of ``batch_size``.

    >>> [replica_bounds(7, 4, i) for i in range(4)]   # the first 7 % 4 replicas get one more
    [(0, 2), (2, 4), (4, 6), (6, 7)]
    """
    if num_replicas < 1 or not 0 <= replica_id < num_replicas or batch_size < 0:
        raise ValueError(
            f"Need batch_size >= 0 and 0 <= replica_id < num_replicas. "
            f"Received: batch_size={batch_size}, num_replicas={num_replicas}, replica_id={replica_id}"
        )
    base, extra = divmod(batch_size, num_replicas)
    start = replica_id * base + min(replica_id, extra)
    return start, start + base + (1 if replica_id < extra else 0)


def _leaves(batch: Any) -> Iterator[Any]:
    if isinstance(batch, dict):
        for value in batch.values():
            yield from _leaves(value)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            yield from _leaves(value)
    else:
        yield batch


def _map(fn: Callable[[Any], Any], batch: Any) -> Any:
    """Apply ``fn`` to every leaf, keeping tuples (and namedtuples), lists and dicts."""
    if isinstance(batch, dict):
        return type(batch)((key, _map(fn, value)) for key, value in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map(fn, value) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map(fn, value) for value in batch)
    return fn(batch)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (torch.Tensor, np.ndarray)) and leaf.ndim > 0


def global_batch_size_of(batch: Any) -> int:
    """The common first dim of every tensor/array in ``batch``; ValueError when they disagree."""
    sizes = {int(leaf.shape[0]) for leaf in _leaves(batch) if _is_array(leaf)}
    if len(sizes) != 1:
        shapes = [tuple(leaf.shape) for leaf in _leaves(batch) if isinstance(leaf, (torch.Tensor, np.ndarray))]
        raise ValueError(
            "Every tensor of a global batch needs the same first (batch) dim to be split over replicas. "
            f"Received: shapes={shapes}"
        )
    return sizes.pop()


def slice_for_replica(batch: Any, num_replicas: int, replica_id: int) -> Any:
    """Replica ``replica_id``'s contiguous slice of a global ``batch`` (tuples/lists/dicts of tensors).

    Tensors and arrays are sliced along dim 0 (views, no copy); other leaves pass unchanged.

    >>> x = torch.arange(5)
    >>> slice_for_replica({"x": x, "y": x * 10}, 2, 1)
    {'x': tensor([3, 4]), 'y': tensor([30, 40])}
    """
    start, stop = replica_bounds(global_batch_size_of(batch), num_replicas, replica_id)
    return _map(lambda leaf: leaf[start:stop] if _is_array(leaf) else leaf, batch)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of ``batch`` to ``device`` (a no-op for tensors already there)."""
    non_blocking = device.type == "cuda"
    return _map(
        lambda leaf: leaf.to(device, non_blocking=non_blocking) if isinstance(leaf, torch.Tensor) else leaf, batch
    )


class DistributedDataset:
    """This replica's slices of an iterable of global batches (returned by
    ``strategy.experimental_distribute_dataset``). Iterate it like the dataset itself.

    Every process must produce the same global batches in the same order: seed any
    shuffling identically on all processes (``DataLoader(..., generator=torch.Generator().manual_seed(0))``).
    """

    def __init__(
        self,
        dataset: Iterable,
        num_replicas: int,
        replica_id: int,
        device: torch.device | None = None,
        on_iter: Callable[[], None] | None = None,
    ):
        if not hasattr(dataset, "__iter__"):
            raise ValueError(f"The dataset must be an iterable of global batches. Received: dataset={dataset!r}")
        replica_bounds(0, num_replicas, replica_id)  # validates the placement
        self._dataset = dataset
        self._num_replicas = int(num_replicas)
        self._replica_id = int(replica_id)
        self._device = device
        self._on_iter = on_iter

    def __iter__(self) -> Iterator[Any]:
        if self._on_iter is not None:
            self._on_iter()  # e.g. mirror parameters created in a still-open scope before step 1
        for batch in self._dataset:
            local = slice_for_replica(batch, self._num_replicas, self._replica_id)
            yield to_device(local, self._device) if self._device is not None else local

    def __len__(self) -> int:
        return len(self._dataset)  # TypeError, as for the dataset, when it has no length


class DatasetFromFunction:
    """The per-replica dataset ``dataset_fn(InputContext)`` returned, its batches moved to the
    replica's device (``strategy.distribute_datasets_from_function``). It must yield the same
    number of batches on every replica, or the replicas' collectives fall out of step."""

    def __init__(
        self, dataset: Iterable, device: torch.device | None = None, on_iter: Callable[[], None] | None = None
    ):
        if not hasattr(dataset, "__iter__"):
            raise ValueError(f"dataset_fn must return an iterable of batches. Received: {dataset!r}")
        self._dataset = dataset
        self._device = device
        self._on_iter = on_iter

    def __iter__(self) -> Iterator[Any]:
        if self._on_iter is not None:
            self._on_iter()
        for batch in self._dataset:
            yield to_device(batch, self._device) if self._device is not None else batch

    def __len__(self) -> int:
        return len(self._dataset)
