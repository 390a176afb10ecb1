"""Split a dataset into global batches, and each global batch over the batch axis.

The order of samples is a function of ``(seed, epoch)`` only, computed identically on every
process, so process ``p`` with data index ``i`` takes slice ``i`` of every global batch and
no process talks to another to agree on it.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate


def as_dataset(data: Any) -> Dataset:
    """A map-style dataset from a Dataset, a tensor/array, or a tuple of them (``from_tensor_slices``)."""
    if isinstance(data, Dataset) and hasattr(data, "__len__"):
        return data
    if isinstance(data, (torch.Tensor, np.ndarray)):
        data = (data,)
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, (torch.Tensor, np.ndarray)) for t in data):
        tensors = [torch.as_tensor(t) for t in data]
        lengths = {len(t) for t in tensors}
        if len(lengths) != 1:
            raise ValueError(f"All arrays must have the same first dim. Received: lengths={[len(t) for t in tensors]}")
        return TensorDataset(*tensors)
    raise TypeError(
        "distribute_dataset takes a map-style Dataset with __len__, a tensor/array, or a tuple of them. "
        f"Received: {type(data).__name__}"
    )


class DistributedBatches:
    """This process's local batches, epoch after epoch (each ``iter()`` starts the next epoch).

    ``len()`` is the number of steps per epoch. With ``micro_batches=k`` every local batch is
    also split into k equal micro-batches (gradient accumulation; ``iter_steps()``). The
    remainder policy: with ``drop_remainder=False`` a final partial global batch is kept when
    it splits into equal parts (data-parallel size x micro-batches), and otherwise dropped
    with a warning (unequal parts would weigh samples unequally in the averaged gradient).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch_size: int,
        data_parallel_size: int,
        data_index: int,
        shuffle: bool,
        seed: int,
        drop_remainder: bool,
        to_global: Callable[[Any], Any] | None = None,
        micro_batches: int = 1,
    ):
        self.dataset = as_dataset(dataset)
        self.global_batch_size = int(global_batch_size)
        self.data_parallel_size = int(data_parallel_size)
        self.data_index = int(data_index)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_remainder = bool(drop_remainder)
        self.epoch = 0
        self._to_global = to_global or (lambda batch: batch)
        self.micro_batches = int(micro_batches)
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1. Received: micro_batches={micro_batches}")
        self._parts = self.data_parallel_size * self.micro_batches
        if self.data_parallel_size < 1 or self.global_batch_size < 1 or self.global_batch_size % self._parts:
            raise ValueError(
                f"global_batch_size must be a positive multiple of data_parallel_size x micro_batches. "
                f"Received: global_batch_size={global_batch_size}, data_parallel_size={data_parallel_size}, "
                f"micro_batches={micro_batches}"
            )
        if not 0 <= self.data_index < self.data_parallel_size:
            raise ValueError(f"data_index must be in [0, {self.data_parallel_size}). Received: {self.data_index}")
        if len(self.dataset) < self.global_batch_size and drop_remainder:
            raise ValueError(
                f"The dataset has {len(self.dataset)} samples, fewer than one global batch of "
                f"{self.global_batch_size} with drop_remainder=True."
            )
        self._remainder = len(self.dataset) % self.global_batch_size
        if self._remainder and not drop_remainder and self._remainder % self._parts:
            warnings.warn(
                f"The last {self._remainder} samples cannot be split evenly over {self.data_parallel_size} "
                f"data-parallel processes x {self.micro_batches} micro-batches and are dropped each epoch.",
                stacklevel=3,
            )

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.data_parallel_size

    def __len__(self) -> int:
        full = len(self.dataset) // self.global_batch_size
        keep_last = self._remainder and not self.drop_remainder and self._remainder % self._parts == 0
        return full + int(bool(keep_last))

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at ``epoch`` (as torch's DistributedSampler)."""
        self.epoch = int(epoch)

    def global_order(self, epoch: int) -> np.ndarray:
        """Sample indices of one epoch, the same on every process."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def local_indices(self, epoch: int) -> Iterator[np.ndarray]:
        order = self.global_order(epoch)
        for step in range(len(self)):
            batch = order[step * self.global_batch_size : (step + 1) * self.global_batch_size]
            part = len(batch) // self.data_parallel_size
            yield batch[self.data_index * part : (self.data_index + 1) * part]

    def _fetch(self, indices: np.ndarray):
        return fetch(self.dataset, indices)

    def __iter__(self) -> Iterator[Any]:
        epoch = self._next_epoch()
        return (self._to_global(self._fetch(indices)) for indices in self.local_indices(epoch))

    def iter_steps(self) -> Iterator[list[Any]]:
        """One list of ``micro_batches`` micro-batches per optimizer step (the next epoch)."""
        epoch = self._next_epoch()
        for indices in self.local_indices(epoch):
            parts = [indices] if self.micro_batches == 1 else np.split(indices, self.micro_batches)
            yield [self._to_global(self._fetch(part)) for part in parts]

    def _next_epoch(self) -> int:
        epoch = self.epoch
        self.epoch += 1  # TF's reshuffle_each_iteration: every pass is the next epoch
        return epoch


def covering_parts(num_rows: int, parts: int) -> list[range]:
    """Split rows 0..num_rows-1 over ``parts`` the way DTensor's ``Shard`` does (``torch.chunk``):
    parts of ceil(n/parts) rows, the last ones shorter or empty."""
    size = -(-num_rows // parts) if num_rows else 0
    return [range(min(i * size, num_rows), min((i + 1) * size, num_rows)) for i in range(parts)]


class CoveringBatches:
    """For evaluation and prediction: every sample exactly once, in order, no padding.

    Yields ``(global_rows, local_indices, local_batch)`` per global batch; the last global
    batch may be short and local batches may be unequal or empty (exact metrics are sums,
    so unequal parts are fine here, unlike in training).
    """

    def __init__(self, dataset: Any, *, batch_size: int, data_parallel_size: int, data_index: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1. Received: batch_size={batch_size}")
        self.dataset = as_dataset(dataset)
        self.batch_size = int(batch_size)
        self.data_parallel_size = int(data_parallel_size)
        self.data_index = int(data_index)

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray, Any]]:
        n = len(self.dataset)
        for start in range(0, n, self.batch_size):
            rows = min(self.batch_size, n - start)
            mine = covering_parts(rows, self.data_parallel_size)[self.data_index]
            indices = np.arange(start + mine.start, start + mine.stop)
            yield rows, indices, fetch(self.dataset, indices)


def fetch(dataset: Dataset, indices: np.ndarray):
    """Collate ``dataset[indices]``; tensor datasets are sliced in one go."""
    if isinstance(dataset, TensorDataset):
        if len(indices) and indices[-1] - indices[0] == len(indices) - 1 and (np.diff(indices) == 1).all():
            start = int(indices[0])  # a contiguous run (no shuffle): a view, no copy
            return tuple(t[start : start + len(indices)] for t in dataset.tensors)
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t[index] for t in dataset.tensors)
    if len(indices) == 0:
        return None
    return default_collate([dataset[int(i)] for i in indices])
