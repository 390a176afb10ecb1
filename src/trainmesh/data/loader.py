"""``tm.data.DataLoader``: torch's DataLoader workers, fed by a resumable sampler, prefetched ahead.

Who does what:

* the sampler (``GlobalBatchSampler``) decides which indices this rank reads, per step;
* torch's ``DataLoader`` (persistent workers) reads them through ``GuardedDataset``, which
  retries transient errors and reports corrupt samples by index instead of raising;
* a ``Prefetcher`` thread pulls finished batches ``prefetch`` steps ahead of the training step
  (pinned and copied to the GPU on a side stream when a CUDA ``device`` is given);
* the consumer side (this module) raises or skips failures, counts ``stats``, fills the cache,
  and moves the sampler's cursor only when a step is handed to the training loop, so
  ``state_dict()`` is exact however far ahead the workers and the thread have read.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from trainmesh.data.batch_slots import BatchSlots
from trainmesh.data.guard import CorruptSampleError, FetchedBatch, GuardedCollate, GuardedDataset
from trainmesh.data.prefetch import DeviceTransfer, Prefetcher
from trainmesh.data.sampler import GlobalBatchSampler
from trainmesh.data.steps import IndexBatches, PlanBatchSampler

_SKIPPED = object()  # a cache entry for a sample known to be corrupt (skip policy): never re-read


@dataclass
class LoaderStats:
    """Counters of what the training loop actually received (not what was read ahead)."""

    steps: int = 0
    batches: int = 0  # micro-batches
    samples: int = 0
    retries: int = 0  # transient read errors that a retry fixed or that exhausted the retries
    skipped: int = 0  # corrupt samples dropped under on_corrupt="skip"
    cache_hits: int = 0  # samples served from the in-memory cache
    wait_s: float = 0.0  # total time the consumer blocked waiting for a step
    last_wait_s: float = 0.0
    # Time the prefetch thread spent getting these steps' batches from the workers (un-pickling
    # included). Why: it tells what a wait is. Per step above the step's own time, the workers are
    # the bottleneck (too few, or starved of CPU) and no prefetch depth hides it; well below it,
    # a wait is latency (the first batch of a pass, scheduling) that depth can hide.
    fetch_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class DataLoader:
    """Batches of ``dataset`` for the indices that ``sampler`` hands this rank, ready ahead of time.

    ``sampler`` is a ``GlobalBatchSampler`` (resumable on any world size) or any iterable of
    index batches (a torch ``BatchSampler``, a list of lists; resumable by batch count). Each
    item of ``iter(loader)`` is one optimizer step: the batch, or, with ``micro_batches > 1``,
    the list of micro-batches (``iter_steps()`` always gives the list).

    >>> import torch, trainmesh as tm
    >>> data = torch.utils.data.TensorDataset(torch.arange(8.0))
    >>> sampler = tm.data.GlobalBatchSampler(8, global_batch_size=4, data_parallel_size=1, data_index=0, shuffle=False)
    >>> with tm.data.DataLoader(data, sampler) as loader:
    ...     [batch[0].tolist() for batch in loader]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    """

    def __init__(
        self,
        dataset: Any,
        sampler: GlobalBatchSampler | Iterable[Iterable[int]],
        *,
        num_workers: int = 0,
        persistent_workers: bool = True,
        prefetch: int = 2,
        pin_memory: bool | str = "auto",
        device: str | torch.device | None = None,
        cache: bool = False,
        max_retries: int = 3,
        retry_delay: float = 0.05,
        retry_on: tuple[type[BaseException], ...] = (OSError, TimeoutError),
        on_corrupt: str = "raise",
        collate_fn: Callable[[list], Any] | None = None,
        multiprocessing_context: Any = None,
        worker_init_fn: Callable[[int], None] | None = None,
    ):
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip'. Received: on_corrupt={on_corrupt!r}")
        if num_workers < 0 or prefetch < 0 or max_retries < 0 or retry_delay < 0:
            raise ValueError(
                f"num_workers, prefetch, max_retries and retry_delay must be >= 0. Received: "
                f"num_workers={num_workers}, prefetch={prefetch}, max_retries={max_retries}, "
                f"retry_delay={retry_delay}"
            )
        self.dataset = dataset
        self.sampler = sampler if isinstance(sampler, GlobalBatchSampler) else IndexBatches(sampler)
        self.prefetch = int(prefetch)
        self.on_corrupt = on_corrupt
        self.stats = LoaderStats()
        self._cache: dict[int, Any] | None = {} if cache else None
        self._collate = collate_fn or torch.utils.data.default_collate
        self._transfer = DeviceTransfer(device, pin_memory)
        self._batch_sampler = PlanBatchSampler()
        guarded = GuardedDataset(
            dataset,
            retry_on=retry_on,
            max_retries=max_retries,
            retry_delay=retry_delay,
            stop_at_first_failure=on_corrupt == "raise",
        )
        # Workers stack batches into reused shared-memory slots (batch_slots.py), not a fresh shared
        # block per batch (its allocation and page faults were 1-2 ms of a worker's ~11 ms per batch
        # at the dataloader benchmark's setting). Torch keeps prefetch_factor (2) results per worker
        # in flight, so 3 slots each; a user's collate_fn allocates its own output: torch's path.
        self._slots = BatchSlots(num_workers, 3, self._transfer.pin_memory) if num_workers and not collate_fn else None
        self._torch_loader = torch.utils.data.DataLoader(
            guarded,
            batch_sampler=self._batch_sampler,
            num_workers=num_workers,
            collate_fn=GuardedCollate(self._slots.collate if self._slots else collate_fn, keep_samples=cache),
            persistent_workers=bool(persistent_workers and num_workers > 0),
            pin_memory=False,  # pinned in our thread, only when it pays (CUDA)
            multiprocessing_context=multiprocessing_context,
            worker_init_fn=worker_init_fn,
        )
        self._prefetcher: Prefetcher | None = None
        self._closed = False

    # --- iteration ------------------------------------------------------------------------
    @property
    def micro_batches(self) -> int:
        return getattr(self.sampler, "micro_batches", 1)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        for parts in self.iter_steps():
            yield parts[0] if self.micro_batches == 1 else parts

    def iter_steps(self) -> Iterator[list[Any]]:
        """The rest of the current epoch (from the sampler's cursor): per step, its micro-batches."""
        if self._closed:
            raise RuntimeError("This DataLoader is closed.")
        self._stop_prefetcher()  # an earlier pass abandoned midway: its read-ahead is discarded
        plan = self.sampler.plan()
        cached = [
            [self._cache is not None and all(int(i) in self._cache for i in m) for m in micro] for _, micro in plan
        ]
        self._batch_sampler.batches = [
            m.tolist() for (_, micro), flags in zip(plan, cached) for m, hit in zip(micro, flags) if not hit
        ]
        produce = lambda: self._produce(plan, cached)  # noqa: E731
        if self.prefetch:
            self._prefetcher = prefetcher = Prefetcher(produce, self.prefetch)
            get = prefetcher.get
        else:
            prefetcher, iterator = None, produce()
            get = lambda: next(iterator)  # noqa: E731
        try:
            while True:
                started = time.perf_counter()
                try:
                    cursor, parts, counts = get()
                except StopIteration:
                    return
                wait = time.perf_counter() - started
                self.stats.wait_s += wait
                self.stats.last_wait_s = wait
                for key, value in counts.items():
                    setattr(self.stats, key, getattr(self.stats, key) + value)
                self.stats.steps += 1
                self.sampler.advance(cursor)  # consumed now, whatever was read ahead
                yield [self._transfer.ready(batch, event) for batch, event in parts]
        finally:
            if prefetcher is not None:
                prefetcher.close()
                if self._prefetcher is prefetcher:
                    self._prefetcher = None

    def _produce(self, plan: list[tuple[int, list[np.ndarray]]], cached: list[list[bool]]) -> Iterator[tuple]:
        """Runs in the prefetch thread: the steps of ``plan``, fetched, checked and transferred."""
        torch_iter = iter(self._torch_loader) if self._batch_sampler.batches else None
        for (cursor, micro), flags in zip(plan, cached):
            counts = {"batches": 0, "samples": 0, "retries": 0, "skipped": 0, "cache_hits": 0, "fetch_s": 0.0}
            parts = []
            for indices, hit in zip(micro, flags):
                started = time.perf_counter()
                fetched = self._from_cache(indices) if hit else next(torch_iter)
                counts["fetch_s"] += time.perf_counter() - started
                if hit:
                    counts["cache_hits"] += len(fetched.indices)
                self._check(fetched, counts)
                counts["batches"] += 1
                counts["samples"] += len(fetched.indices)
                parts.append(self._transfer.to_device(fetched.batch))
            yield cursor, parts, counts

    def _check(self, fetched: FetchedBatch, counts: dict[str, int]) -> None:
        counts["retries"] += fetched.retries
        if fetched.failures and self.on_corrupt == "raise":
            index, text = fetched.failures[0]
            raise CorruptSampleError(f"sample {index} of {self.dataset!r} failed: {text}", index=index)
        counts["skipped"] += len(fetched.failures)
        if self._cache is not None:
            if fetched.samples is not None:
                self._cache.update(zip(fetched.indices, fetched.samples))
            self._cache.update((index, _SKIPPED) for index, _ in fetched.failures)

    def _from_cache(self, indices: np.ndarray) -> FetchedBatch:
        kept = [int(i) for i in indices if self._cache[int(i)] is not _SKIPPED]
        samples = [self._cache[i] for i in kept]
        # Known-corrupt samples stay skipped (counted again, as each pass drops them again).
        failures = [(int(i), "skipped before") for i in indices if self._cache[int(i)] is _SKIPPED]
        batch = self._collate(samples) if samples else None
        return FetchedBatch(batch=batch, indices=kept, samples=None, failures=failures)

    # --- state ----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state as of the last step handed out (read-ahead is not counted)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._stop_prefetcher()
        self.sampler.load_state_dict(state)

    # --- shutdown -------------------------------------------------------------------------
    def _stop_prefetcher(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def close(self) -> None:
        """Stop the prefetch thread and the persistent workers. Idempotent."""
        if getattr(self, "_closed", True):  # closed, or __init__ failed before the loader existed
            return
        self._closed = True
        self._stop_prefetcher()
        iterator = getattr(self._torch_loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._torch_loader._iterator = None
        if self._slots is not None:
            self._slots.close()

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
            warnings.warn("trainmesh DataLoader could not shut down cleanly", RuntimeWarning, stacklevel=1)
