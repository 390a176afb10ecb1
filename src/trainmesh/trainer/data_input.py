"""What ``fit``/``evaluate``/``predict`` accept, turned into this process's batches.

* a map-style Dataset (or a tuple of tensors/arrays): split by trainmesh, seeded, reshuffled
  every epoch, every sample exactly once per epoch across the data-parallel processes;
  ``batch_size`` is the global batch;
* a DataLoader whose sampler is a ``DistributedSampler``: already this process's share;
  each of its batches is one micro-batch and ``grad_accum_steps`` of them make a step
  (Lightning's semantics);
* any other iterable (a DataLoader included): each item is a GLOBAL batch, split over the
  batch axis and into micro-batches (TensorFlow's distributed-dataset semantics).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, TensorDataset

from trainmesh.data import DataLoader, GlobalBatchSampler
from trainmesh.distribution.dataset import CoveringBatches, as_dataset, covering_parts, fetch
from trainmesh.runtime import local_torch_device


def is_map_style(data: Any) -> bool:
    if isinstance(data, (TorchDataLoader, IterableDataset)):
        return False
    if isinstance(data, Dataset) and hasattr(data, "__len__"):
        return True
    return (
        isinstance(data, (tuple, list)) and bool(data) and all(isinstance(t, (torch.Tensor, np.ndarray)) for t in data)
    )


def is_presharded(data: Any) -> bool:
    return isinstance(data, TorchDataLoader) and isinstance(getattr(data, "sampler", None), DistributedSampler)


def _slice_rows(batch: Any, rows: range) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[rows.start : rows.stop]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice_rows(b, rows) for b in batch)
    if isinstance(batch, dict):
        return {k: _slice_rows(v, rows) for k, v in batch.items()}
    raise TypeError(f"Batches must hold tensors (in tuples, lists or dicts). Received: {type(batch).__name__}")


def _num_rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, (tuple, list)) and batch:
        return _num_rows(batch[0])
    if isinstance(batch, dict) and batch:
        return _num_rows(next(iter(batch.values())))
    raise TypeError(f"Batches must hold tensors (in tuples, lists or dicts). Received: {type(batch).__name__}")


class TrainSteps:
    """Per optimizer step, this process's list of ``grad_accum_steps`` micro-batches."""

    def __init__(
        self,
        data: Any,
        distribution,
        *,
        global_batch_size: int | None,
        grad_accum_steps: int,
        shuffle: bool,
        seed: int,
        drop_remainder: bool,
    ):
        self.distribution = distribution
        self.k = grad_accum_steps
        self.dp = distribution.data_parallel_size if distribution.auto_shard_dataset else 1
        self.data_index = distribution.data_index() if distribution.auto_shard_dataset else 0
        self.sampler: GlobalBatchSampler | None = None
        self.loader: DataLoader | None = None
        self._last_micro: list = []  # this process's micro-batches' indices, of the step last handed out
        self.data = data
        self.num_samples = None
        if is_map_style(data):
            if global_batch_size is None:
                raise ValueError("fit(batch_size=...) is required for a Dataset: it is the global batch size.")
            self.dataset = as_dataset(data)
            self.num_samples = len(self.dataset)
            # (seed, epoch, cursor) state: a checkpoint taken mid-epoch resumes exactly there, on
            # any number of processes; same order and split as distribute_dataset.
            self.sampler = GlobalBatchSampler(
                self.num_samples,
                global_batch_size=global_batch_size,
                data_parallel_size=self.dp,
                data_index=self.data_index,
                micro_batches=self.k,
                shuffle=shuffle,
                seed=seed,
                drop_remainder=drop_remainder,
            )
            if not isinstance(self.dataset, TensorDataset):
                # Real datasets read samples: fetch them ahead of the step (a thread; workers optional).
                self.loader = DataLoader(self.dataset, self.sampler, prefetch=2)

    def __len__(self) -> int:
        if self.sampler is not None:
            return len(self.sampler)  # steps left in this epoch (fewer after a mid-epoch resume)
        if is_presharded(self.data):
            return len(self.data) // self.k
        return len(self.data)  # raises TypeError for unsized iterables, as len() should

    def has_length(self) -> bool:
        try:
            len(self)
        except TypeError:
            return False
        return True

    def set_epoch(self, epoch: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)  # the current epoch keeps its cursor (a resume)
        sampler = getattr(self.data, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def state_dict(self) -> dict | None:
        return self.sampler.state_dict() if self.sampler is not None else None

    def finished_epoch(self, epoch: int) -> bool:
        """Whether every step of ``epoch`` was handed out: the sampler moves to the next epoch right
        after the last one, before the loop's end-of-epoch work (evaluation, callbacks) runs."""
        return self.sampler is not None and self.sampler.epoch > epoch

    def load_state_dict(self, state: dict | None) -> None:
        if state and self.sampler is not None:
            self.sampler.load_state_dict(state)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()

    @property
    def last_indices(self) -> list[int]:
        """This process's samples of the step last handed out (in-memory tensors only); flattened
        when asked for (a sample log), not at every step."""
        return [int(i) for m in self._last_micro for i in m]

    def __iter__(self) -> Iterator[list[Any]]:
        # The device is looked up once per epoch, not per batch: right after an optimizer step the
        # lookup's code is out of the CPU caches, and it cost ~40 us a step on CPU.
        device = local_torch_device()
        if self.loader is not None:
            return self._loader_steps(device)
        if self.sampler is not None:
            return self._tensor_steps(device)
        if is_presharded(self.data):
            return self._presharded_steps(device)
        return self._global_batch_steps(device)

    def _to_model(self, batch: Any, device) -> Any:
        return self.distribution._batch_to_global(batch, device)

    def _tensor_steps(self, device) -> Iterator[list[Any]]:
        # In-memory tensors: slice them, no loader needed (unshuffled, as views of the data).
        ascending = self.sampler.ascending_runs
        for micro in self.sampler.iter_step_arrays():
            self._last_micro = micro
            yield [self._to_model(fetch(self.dataset, m, ascending_run=ascending), device) for m in micro]

    def _loader_steps(self, device) -> Iterator[list[Any]]:
        for micro in self.loader.iter_steps():
            yield [self._to_model(b, device) for b in micro]

    def _presharded_steps(self, device) -> Iterator[list[Any]]:
        iterator = iter(self.data)
        while True:
            group = list(itertools.islice(iterator, self.k))
            if len(group) < self.k:
                return  # a trailing partial group would weigh its samples differently
            yield [self._to_model(b, device) for b in group]

    def _global_batch_steps(self, device) -> Iterator[list[Any]]:
        parts = self.dp * self.k
        for batch in self.data:
            rows = _num_rows(batch)
            if rows % parts:
                raise ValueError(
                    f"A global batch of {rows} rows cannot be split over {self.dp} data-parallel processes x "
                    f"{self.k} micro-batches. Received: a batch of {rows} rows from {type(self.data).__name__}"
                )
            size = rows // parts
            first = self.data_index * self.k
            yield [
                self._to_model(_slice_rows(batch, range((first + j) * size, (first + j + 1) * size)), device)
                for j in range(self.k)
            ]


def eval_batches(data: Any, distribution, *, batch_size: int | None) -> Iterator[tuple[int, Any]]:
    """``(global_rows, local_batch)`` covering every sample once (uneven local parts allowed)."""
    dp = distribution.data_parallel_size if distribution.auto_shard_dataset else 1
    index = distribution.data_index() if distribution.auto_shard_dataset else 0
    if is_map_style(data):
        if batch_size is None:
            raise ValueError("evaluate/predict need batch_size=... for a Dataset.")
        for rows, _, batch in CoveringBatches(data, batch_size=batch_size, data_parallel_size=dp, data_index=index):
            yield rows, batch
    elif is_presharded(data):
        raise ValueError(
            "evaluate/predict split the data themselves to count every sample exactly once; pass the Dataset, "
            "not a DataLoader with a DistributedSampler (which pads with repeated samples)."
        )
    else:
        for batch in data:
            rows = _num_rows(batch)
            yield rows, _slice_rows(batch, covering_parts(rows, dp)[index])
