"""A stateful global-batch sampler: (seed, epoch, cursor) is all it takes to resume, on any world size.

The order of an epoch is a seeded permutation computed identically on every process, and the
job walks it one GLOBAL batch at a time. The state is not "which local batch was I on" but the
number of samples of this epoch the whole job has consumed (the *cursor*), so a job saved on 2
processes can resume on 4: the remaining global batches are simply split over the new ranks,
and every sample of the epoch is still consumed exactly once.

The order and the split are exactly those of ``trainmesh.distribution.dataset.DistributedBatches``
(same seed and epoch -> same global batches -> same contiguous part per data index), so a loop
driven by either sees the same numbers.
"""

from __future__ import annotations

import warnings
from collections.abc import Sized
from typing import Any, Iterator

import numpy as np


class GlobalBatchSampler:
    """This rank's indices of each global batch, resumable from ``(seed, epoch, cursor)``.

    Every ``global_batch_size`` consecutive samples of the epoch's order form a global batch;
    data index ``i`` takes the ``i``-th of ``data_parallel_size`` contiguous parts, and that part
    is split into ``micro_batches`` contiguous micro-batches (gradient accumulation).

    Iteration:

    * ``iter(sampler)`` yields, per optimizer step, this rank's indices (a ``list[int]``; usable
      as a torch ``batch_sampler`` when ``micro_batches == 1``); ``iter_steps()`` yields them
      split into ``micro_batches`` lists.
    * Iteration starts at the cursor and advances it as each step is handed out. When the last
      step of the epoch is handed out, the sampler moves to ``(epoch + 1, cursor 0)`` (as
      ``DistributedBatches``: each full pass is the next epoch). A pass abandoned midway leaves
      the cursor where it stopped, and the next ``iter()`` continues from there.

    Remainder policy (as ``DistributedBatches``): with ``drop_remainder=False`` a final partial
    global batch is kept when it splits into equal parts (``data_parallel_size x micro_batches``)
    and otherwise dropped with a warning; unequal parts would weigh samples unequally in the
    averaged gradient. After a resume on another world size the rule is applied with the NEW
    world size, so the kept tail can differ if it divides one world size and not the other;
    every full global batch is consumed exactly once regardless.

    >>> s = GlobalBatchSampler(8, global_batch_size=4, data_parallel_size=2, data_index=1, shuffle=False)
    >>> list(s)
    [[2, 3], [6, 7]]
    >>> s.state_dict()["epoch"], s.state_dict()["cursor"]
    (1, 0)
    """

    def __init__(
        self,
        num_samples: int | Sized,
        *,
        global_batch_size: int,
        data_parallel_size: int | None = None,
        data_index: int | None = None,
        micro_batches: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = False,
    ):
        if not isinstance(num_samples, (int, np.integer)):
            num_samples = len(num_samples)  # a Sized dataset
        if data_parallel_size is None or data_index is None:
            from trainmesh import runtime  # the job's ranks, when the caller does not say

            data_parallel_size = runtime.world_size() if data_parallel_size is None else data_parallel_size
            data_index = runtime.rank() if data_index is None else data_index
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.micro_batches = int(micro_batches)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_remainder = bool(drop_remainder)
        self.epoch = 0
        self.cursor = 0
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0. Received: num_samples={num_samples}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1. Received: micro_batches={micro_batches}")
        self._set_ranks(int(data_parallel_size), int(data_index))
        if self.num_samples < self.global_batch_size and self.drop_remainder:
            raise ValueError(
                f"The dataset has {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch_size} with drop_remainder=True. Received: num_samples={self.num_samples}"
            )
        remainder = self.num_samples % self.global_batch_size
        if remainder and not self.drop_remainder and remainder % self._parts:
            warnings.warn(
                f"The last {remainder} samples cannot be split evenly over {self.data_parallel_size} "
                f"data-parallel processes x {self.micro_batches} micro-batches and are dropped each epoch.",
                stacklevel=2,
            )

    def _set_ranks(self, data_parallel_size: int, data_index: int) -> None:
        parts = data_parallel_size * self.micro_batches
        if data_parallel_size < 1 or self.global_batch_size < 1 or self.global_batch_size % parts:
            raise ValueError(
                "global_batch_size must be a positive multiple of data_parallel_size x micro_batches. "
                f"Received: global_batch_size={self.global_batch_size}, data_parallel_size={data_parallel_size}, "
                f"micro_batches={self.micro_batches}"
            )
        if not 0 <= data_index < data_parallel_size:
            raise ValueError(f"data_index must be in [0, {data_parallel_size}). Received: data_index={data_index}")
        self.data_parallel_size, self.data_index, self._parts = data_parallel_size, data_index, parts

    # --- the plan of an epoch -------------------------------------------------------------
    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.data_parallel_size

    @property
    def ascending_runs(self) -> bool:
        """Whether every micro-batch this sampler hands out is a run of consecutive, ascending
        indices: unshuffled, the epoch's order is 0..n-1 cut into consecutive pieces. Its rows of an
        in-memory tensor are then a slice from the first index (``fetch(..., ascending_run=True)``)."""
        return not self.shuffle

    def global_order(self, epoch: int) -> np.ndarray:
        """Sample indices of one epoch, the same on every process (as ``DistributedBatches``)."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)

    def global_batches(self, epoch: int | None = None, cursor: int | None = None) -> list[tuple[int, int]]:
        """``(start, stop)`` positions in the epoch's order of the global batches from ``cursor`` on."""
        epoch = self.epoch if epoch is None else epoch
        cursor = self.cursor if cursor is None else cursor
        bounds = [
            (start, start + self.global_batch_size)
            for start in range(cursor, self.num_samples - self.global_batch_size + 1, self.global_batch_size)
        ]
        tail_start = bounds[-1][1] if bounds else cursor
        if self._tail_is_a_step(self.num_samples - tail_start):
            bounds.append((tail_start, self.num_samples))
        return bounds

    def _tail_is_a_step(self, tail: int) -> bool:
        """Whether the ``tail`` samples left after the last full global batch make one more step."""
        return tail > 0 and not self.drop_remainder and tail % self._parts == 0

    def _has_step_from(self, cursor: int) -> bool:
        """Whether ``global_batches(cursor=cursor)`` is non-empty, in O(1): it is asked after every
        step, and building the rest of the epoch's list there made an epoch quadratic in its steps."""
        return cursor + self.global_batch_size <= self.num_samples or self._tail_is_a_step(self.num_samples - cursor)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in a full epoch (from cursor 0)."""
        return len(self.global_batches(cursor=0))

    def __len__(self) -> int:
        """Steps left in the current epoch (from the cursor): what ``iter()`` will yield."""
        return len(self.global_batches())

    def plan(self) -> list[tuple[int, list[np.ndarray]]]:
        """The rest of the current epoch: per step, ``(cursor after it, this rank's micro-batches)``.

        Pure: does not move the cursor. A loader that fetches ahead uses it and reports back
        with ``advance(cursor)`` as each step is actually consumed.
        """
        return self.local_steps(self.epoch, self.cursor)

    def local_steps(self, epoch: int, cursor: int = 0) -> list[tuple[int, list[np.ndarray]]]:
        """As ``plan``, for any ``(epoch, cursor)``; pure (reads no iteration state)."""
        order = self.global_order(epoch)
        steps = []
        for start, stop in self.global_batches(epoch, cursor):
            part = (stop - start) // self.data_parallel_size
            local = order[start + self.data_index * part : start + (self.data_index + 1) * part]
            steps.append((stop, np.split(local, self.micro_batches)))
        return steps

    def advance(self, cursor: int) -> None:
        """Record that the whole job has consumed the epoch's order up to ``cursor``; past the
        last step of the epoch, move to the next epoch at cursor 0."""
        self.cursor = int(cursor)
        if not self._has_step_from(self.cursor):
            self.epoch, self.cursor = self.epoch + 1, 0

    # --- iteration ------------------------------------------------------------------------
    def iter_steps(self) -> Iterator[list[list[int]]]:
        """Per optimizer step, this rank's ``micro_batches`` lists of indices."""
        for micro in self.iter_step_arrays():
            yield [m.tolist() for m in micro]

    def iter_step_arrays(self) -> Iterator[list[np.ndarray]]:
        """As ``iter_steps``, the indices as int64 arrays (what slicing tensors takes, with no
        round trip through Python lists)."""
        for cursor, micro in self.plan():
            # Advance before yielding: once the consumer holds the step, it counts as consumed
            # (a checkpoint taken inside the loop body must not replay it).
            self.advance(cursor)
            yield micro

    def __iter__(self) -> Iterator[list[int]]:
        for micro in self.iter_steps():
            yield [i for m in micro for i in m]

    def set_epoch(self, epoch: int, cursor: int | None = None) -> None:
        """Go to ``epoch`` (as torch's ``DistributedSampler.set_epoch``).

        Setting the epoch the sampler is already in keeps its cursor, so a loop that calls
        ``set_epoch(e)`` at the top of every epoch does not undo a mid-epoch resume; pass
        ``cursor=0`` to restart an epoch explicitly.
        """
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0. Received: epoch={epoch}")
        if cursor is None:
            cursor = self.cursor if epoch == self.epoch else 0
        self._check_cursor(cursor)
        self.epoch, self.cursor = epoch, int(cursor)

    # --- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly; the world size is recorded for information only."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "drop_remainder": self.drop_remainder,
            "micro_batches": self.micro_batches,
            "data_parallel_size": self.data_parallel_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state, on this sampler's world size (it may differ from the saved one).

        The seed, epoch and cursor come from ``state`` (they define the order and the position);
        the split comes from this sampler (its ``data_parallel_size``, ``data_index`` and
        ``micro_batches``). The dataset size and shuffle flag must match: another order would
        silently repeat or skip samples.
        """
        for key in ("seed", "epoch", "cursor"):
            if key not in state:
                raise ValueError(f"A sampler state needs {key!r}. Received: keys={sorted(state)}")
        for key in ("num_samples", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"The saved sampler state has {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; the epoch order would differ. Received: state[{key!r}]={state[key]!r}"
                )
        saved_batch = state.get("global_batch_size", self.global_batch_size)
        if saved_batch != self.global_batch_size:
            # Still exactly-once (the cursor counts samples, not batches), but the steps differ.
            warnings.warn(
                f"The global batch changed from {saved_batch} to {self.global_batch_size} on resume; "
                f"continuing from sample {state['cursor']} of epoch {state['epoch']}.",
                stacklevel=2,
            )
        self.seed = int(state["seed"])
        self._check_cursor(state["cursor"])
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        if self.cursor and not self._has_step_from(self.cursor):
            self.advance(self.cursor)  # saved after the epoch's last step: the next epoch starts

    def _check_cursor(self, cursor: int) -> None:
        if not 0 <= int(cursor) <= self.num_samples:
            raise ValueError(f"cursor must be in [0, {self.num_samples}]. Received: cursor={cursor}")

    def __repr__(self) -> str:
        return (
            f"GlobalBatchSampler(num_samples={self.num_samples}, global_batch_size={self.global_batch_size}, "
            f"data_index={self.data_index}/{self.data_parallel_size}, micro_batches={self.micro_batches}, "
            f"seed={self.seed}, epoch={self.epoch}, cursor={self.cursor})"
        )
