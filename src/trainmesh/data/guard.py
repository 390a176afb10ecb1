"""Reading samples defensively: retries of transient errors, and corrupt samples reported by index.

This runs wherever ``dataset[i]`` runs, in the main process or in a DataLoader worker. A
failure is never raised from here: it travels back with the batch (as text, which always
pickles), so the main process decides what to do (raise ``CorruptSampleError`` naming the
sample, or skip and count it) the same way with or without workers.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate


class CorruptSampleError(RuntimeError):
    """Reading or decoding one sample failed (after any retries); the message names its index."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


@dataclass
class FetchedBatch:
    """One micro-batch as it comes back from a worker (or from the cache)."""

    batch: Any  # collated samples; None when every sample was skipped
    indices: list[int]  # the indices actually in ``batch``
    samples: list | None = None  # the uncollated samples, when the loader caches them
    retries: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)  # (index, "Type: message\n<traceback>")


class _Items(list):
    """``__getitems__``'s result: the samples, plus what happened while reading them."""

    indices: list[int]
    retries: int
    failures: list[tuple[int, str]]


class GuardedDataset(Dataset):
    """``dataset`` with retries and failure capture; its ``__getitems__`` feeds ``GuardedCollate``."""

    def __init__(
        self,
        dataset: Any,
        *,
        retry_on: tuple[type[BaseException], ...],
        max_retries: int,
        retry_delay: float,
        stop_at_first_failure: bool,
    ):
        self.dataset = dataset
        self.retry_on = tuple(retry_on)
        self.max_retries = int(max_retries)
        self.retry_delay = float(retry_delay)
        self.stop_at_first_failure = stop_at_first_failure  # on_corrupt="raise": the rest is wasted work

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> _Items:
        items = _Items()
        items.indices, items.retries, items.failures = [], 0, []
        for index in indices:
            index = int(index)
            sample, retries, failure = self._read(index)
            items.retries += retries
            if failure is not None:
                items.failures.append((index, failure))
                if self.stop_at_first_failure:
                    break
                continue
            items.append(sample)
            items.indices.append(index)
        return items

    def _read(self, index: int) -> tuple[Any, int, str | None]:
        """``(sample, retries used, None)`` or ``(None, retries used, failure text)``."""
        attempt = 0
        while True:
            try:
                return self.dataset[index], attempt, None
            except self.retry_on as exc:
                if attempt == self.max_retries:
                    return None, attempt, _describe(exc, f" after {attempt} retries")
                # Exponential backoff: a flaky network filesystem needs longer the more it fails.
                time.sleep(self.retry_delay * (2**attempt))
                attempt += 1
            except Exception as exc:  # noqa: BLE001 - any other error of the user's dataset: corrupt sample
                return None, attempt, _describe(exc, "")


def _describe(exc: BaseException, suffix: str) -> str:
    return f"{type(exc).__name__}{suffix}: {exc}\n{''.join(traceback.format_exception(exc))}"


class GuardedCollate:
    """Collate the samples that were read; keep them uncollated too when the loader caches."""

    def __init__(self, collate_fn: Callable[[list], Any] | None, keep_samples: bool):
        self.collate_fn = collate_fn or default_collate
        self.keep_samples = keep_samples

    def __call__(self, items: _Items) -> FetchedBatch:
        batch = self.collate_fn(list(items)) if len(items) else None
        return FetchedBatch(
            batch=batch,
            indices=list(items.indices),
            samples=list(items) if self.keep_samples else None,
            retries=items.retries,
            failures=list(items.failures),
        )
