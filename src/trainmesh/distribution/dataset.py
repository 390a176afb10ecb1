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

    ``len()`` is the number of steps per epoch. The remainder policy: with
    ``drop_remainder=False`` a final partial global batch is kept when it can be split over the
    batch axis into equal parts, and otherwise dropped with a warning (unequal local
    batches would weigh samples unequally in the averaged gradient).
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
        if self.data_parallel_size < 1 or self.global_batch_size < 1 or self.global_batch_size % self.data_parallel_size:
            raise ValueError(
                f"global_batch_size must be a positive multiple of data_parallel_size. "
                f"Received: global_batch_size={global_batch_size}, data_parallel_size={data_parallel_size}"
            )
        if not 0 <= self.data_index < self.data_parallel_size:
            raise ValueError(f"data_index must be in [0, {self.data_parallel_size}). Received: {self.data_index}")
        if len(self.dataset) < self.global_batch_size and drop_remainder:
            raise ValueError(
                f"The dataset has {len(self.dataset)} samples, fewer than one global batch of "
                f"{self.global_batch_size} with drop_remainder=True."
            )
        self._remainder = len(self.dataset) % self.global_batch_size
        if self._remainder and not drop_remainder and self._remainder % self.data_parallel_size:
            warnings.warn(
                f"The last {self._remainder} samples cannot be split evenly over {self.data_parallel_size} "
                "data-parallel processes and are dropped each epoch.",
                stacklevel=3,
            )

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.data_parallel_size

    def __len__(self) -> int:
        full = len(self.dataset) // self.global_batch_size
        keep_last = self._remainder and not self.drop_remainder and self._remainder % self.data_parallel_size == 0
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
        if isinstance(self.dataset, TensorDataset):
            index = torch.as_tensor(indices, dtype=torch.long)
            return tuple(t[index] for t in self.dataset.tensors)
        return default_collate([self.dataset[int(i)] for i in indices])

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        self.epoch += 1  # TF's reshuffle_each_iteration: every iter() is the next pass
        return (self._to_global(self._fetch(indices)) for indices in self.local_indices(epoch))
