"""Split a dataset into global batches, and each global batch over the batch axis.

The order of samples is a function of ``(seed, epoch)`` only, computed identically on every
process, so process ``p`` with data index ``i`` takes slice ``i`` of every global batch and
no process talks to another to agree on it.
"""

from __future__ import annotations

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
        # The order, the split and the remainder policy are GlobalBatchSampler's (one definition
        # for the Keras-style dataset, the Trainer and resumable loading); this class adds
        # fetching, the global-batch conversion and "each iter() is the next epoch".
        from trainmesh.data.sampler import GlobalBatchSampler

        self.dataset = as_dataset(dataset)
        self.sampler = GlobalBatchSampler(
            len(self.dataset),
            global_batch_size=global_batch_size,
            data_parallel_size=data_parallel_size,
            data_index=data_index,
            micro_batches=micro_batches,
            shuffle=shuffle,
            seed=seed,
            drop_remainder=drop_remainder,
        )
        self.epoch = 0
        self._to_global = to_global or (lambda batch: batch)

    global_batch_size = property(lambda self: self.sampler.global_batch_size)
    data_parallel_size = property(lambda self: self.sampler.data_parallel_size)
    data_index = property(lambda self: self.sampler.data_index)
    micro_batches = property(lambda self: self.sampler.micro_batches)
    shuffle = property(lambda self: self.sampler.shuffle)
    seed = property(lambda self: self.sampler.seed)
    drop_remainder = property(lambda self: self.sampler.drop_remainder)
    local_batch_size = property(lambda self: self.sampler.local_batch_size)

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at ``epoch`` (as torch's DistributedSampler)."""
        self.epoch = int(epoch)

    def global_order(self, epoch: int) -> np.ndarray:
        """Sample indices of one epoch, the same on every process."""
        return self.sampler.global_order(epoch)

    def _micro_indices(self, epoch: int) -> Iterator[list[np.ndarray]]:
        # Pure: two iterators over the same object never share a cursor.
        for _, micro in self.sampler.local_steps(epoch):
            yield micro

    def local_indices(self, epoch: int) -> Iterator[np.ndarray]:
        for micro in self._micro_indices(epoch):
            yield micro[0] if len(micro) == 1 else np.concatenate(micro)

    def _fetch(self, indices: np.ndarray):
        return fetch(self.dataset, indices, ascending_run=self.sampler.ascending_runs)

    def __iter__(self) -> Iterator[Any]:
        epoch = self._next_epoch()
        return (self._to_global(self._fetch(indices)) for indices in self.local_indices(epoch))

    def iter_steps(self) -> Iterator[list[Any]]:
        """One list of ``micro_batches`` micro-batches per optimizer step (the next epoch)."""
        epoch = self._next_epoch()
        for micro in self._micro_indices(epoch):
            yield [self._to_global(self._fetch(part)) for part in micro]

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


def fetch(dataset: Dataset, indices: np.ndarray, *, ascending_run: bool = False):
    """Collate ``dataset[indices]``; tensor datasets are sliced in one go, as a view when the indices
    are consecutive. ``ascending_run``: the caller knows they are (an unshuffled order, cut into
    consecutive pieces), so they are not checked: that numpy check cost ~70 us a step on CPU, run
    right after an optimizer step, when its code is out of the caches."""
    if isinstance(dataset, TensorDataset):
        if len(indices) and (
            ascending_run or (indices[-1] - indices[0] == len(indices) - 1 and (np.diff(indices) == 1).all())
        ):
            start = int(indices[0])  # a view, no copy
            return tuple(t[start : start + len(indices)] for t in dataset.tensors)
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t[index] for t in dataset.tensors)
    if len(indices) == 0:
        return None
    return default_collate([dataset[int(i)] for i in indices])
