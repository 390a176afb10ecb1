"""A streaming, resumable dataset over a directory of memory-mapped token shards.

The unit of data is a *window* of ``block_size + 1`` consecutive tokens, read as
``input = window[:-1]``, ``target = window[1:]``. Window ``j`` of a shard starts at token
``j * block_size``, so the inputs do not overlap and every token is predicted once (the
demo's ``CharWindows`` cuts the same windows). Windows never straddle two shards: each shard
loses at most ``block_size`` tail tokens, and a window never mixes unrelated files.

The order of windows in an epoch is ``default_rng([seed, epoch]).permutation(n)``, the same on
every process. Global batches are consecutive runs of that order; process ``data_index`` takes
the ``data_index``-th contiguous part of each (as ``DistributedBatches``). The position in an
epoch is one number for the whole job, the *cursor* (windows handed out so far), so a job saved
on N processes resumes on M: the remaining windows are cut into the same global batches and
re-split, and every window is still seen exactly once per epoch.
"""

from __future__ import annotations

import json
import mmap
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from .shard_writer import FORMATS, INDEX_NAME, file_sha256


class ShardError(ValueError):
    """A shard directory is incomplete or a shard does not match its index."""


class TokenShardDataset(Dataset):
    """Windows of ``block_size + 1`` tokens over the shards written by ``write_token_shards``.

    Two ways to read it:

    * ``iter_batches(global_batch_size)``: this process's ``(inputs, targets)`` int64 tensors of
      shape ``(global_batch_size // data_parallel_size, block_size)``, one per global batch,
      for the rest of the current epoch, resumable with ``state_dict()``/``load_state_dict()``;
    * map-style, ``len(ds)`` windows and ``ds[i] -> (input, target)`` of shape ``(block_size,)``,
      so the Trainer or ``DistributedBatches`` can shuffle and split it themselves.

    >>> ds = TokenShardDataset("shards/", block_size=256, seed=0)   # doctest: +SKIP
    >>> for x, y in ds.iter_batches(global_batch_size=64):          # doctest: +SKIP
    ...     loss = model(x, y); ...; save({"data": ds.state_dict()})
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        block_size: int,
        seed: int = 0,
        shuffle: bool = True,
        data_parallel_size: int | None = None,
        data_index: int | None = None,
        drop_remainder: bool = False,
        verify_checksums: bool = False,
    ):
        if int(block_size) < 1:
            raise ValueError(f"block_size must be >= 1. Received: block_size={block_size}")
        self.directory = Path(directory)
        self.block_size = int(block_size)
        self.seed, self.shuffle, self.drop_remainder = int(seed), bool(shuffle), bool(drop_remainder)
        if data_parallel_size is None or data_index is None:
            from trainmesh import runtime  # the default split: one data-parallel part per process

            data_parallel_size = runtime.world_size() if data_parallel_size is None else data_parallel_size
            data_index = runtime.rank() if data_index is None else data_index
        self.data_parallel_size, self.data_index = int(data_parallel_size), int(data_index)
        if self.data_parallel_size < 1 or not 0 <= self.data_index < self.data_parallel_size:
            raise ValueError(
                f"data_index must be in [0, data_parallel_size). Received: "
                f"data_index={data_index}, data_parallel_size={data_parallel_size}"
            )
        self.index = _read_index(self.directory)
        self.dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
        self._check_shards(verify_checksums)
        counts = np.array(self.index["shard_tokens"], dtype=np.int64)
        # Windows per shard: starts at 0, B, 2B, ... while start + B + 1 <= tokens.
        per_shard = np.where(counts > self.block_size, (counts - 1) // self.block_size, 0)
        self._first_window = np.concatenate([[0], np.cumsum(per_shard)])
        if self._first_window[-1] == 0:
            raise ValueError(
                f"No shard of {str(self.directory)!r} holds block_size + 1 = {self.block_size + 1} "
                f"tokens. Received: shard sizes {counts.tolist()}"
            )
        self._arrays: list[np.ndarray] | None = None  # opened lazily, again after pickling
        self.epoch, self.cursor, self.global_batch_size = 0, 0, None

    # --- opening -------------------------------------------------------------------------------

    def _path(self, shard: int) -> Path:
        return self.directory / self.index["shards"][shard]["file"]

    def _check_shards(self, verify_checksums: bool) -> None:
        """Sizes always (cheap, from the file system); checksums on request (reads every byte)."""
        for i, entry in enumerate(self.index["shards"]):
            path, tokens = self._path(i), int(entry["tokens"])
            if not path.is_file():
                raise ShardError(
                    f"Shard {entry['file']!r} listed in {INDEX_NAME} is missing from {str(self.directory)!r}"
                )
            if self.index["format"] == "bin" and path.stat().st_size != tokens * self.dtype.itemsize:
                raise ShardError(
                    f"Shard {entry['file']!r} has {path.stat().st_size} bytes; {INDEX_NAME} says "
                    f"{tokens} tokens x {self.dtype.itemsize} = {tokens * self.dtype.itemsize} bytes"
                )
            if self.index["format"] == "npy":
                array = self._open(i)  # reads the header only
                if array.dtype != self.dtype or array.shape != (tokens,):
                    raise ShardError(
                        f"Shard {entry['file']!r} holds {array.dtype} {array.shape}; "
                        f"{INDEX_NAME} says {self.dtype} ({tokens},)"
                    )
            if verify_checksums and file_sha256(path) != entry["sha256"]:
                raise ShardError(f"Shard {entry['file']!r} fails its sha256 check: it changed after it was written")

    def _open(self, shard: int) -> np.ndarray:
        path, tokens = self._path(shard), int(self.index["shards"][shard]["tokens"])
        if self.index["format"] == "npy":
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            array = np.memmap(path, dtype=self.dtype, mode="r", shape=(tokens,))
        raw = getattr(array, "_mmap", None)
        if self.shuffle and raw is not None and hasattr(mmap, "MADV_RANDOM"):
            # Shuffled windows are a few hundred bytes at random offsets: the kernel's default
            # readahead would read ~128 KiB around each one, hundreds of times what is used.
            raw.madvise(mmap.MADV_RANDOM)
        return array

    @property
    def arrays(self) -> list[np.ndarray]:
        """One read-only memory map per shard: pages are read on demand, never the whole corpus."""
        if self._arrays is None:
            self._arrays = [self._open(i) for i in range(len(self.index["shards"]))]
        return self._arrays

    def __getstate__(self) -> dict[str, Any]:
        # A pickled np.memmap carries its whole contents; DataLoader workers reopen the files instead.
        return {**self.__dict__, "_arrays": None}

    # --- map-style access ----------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self._first_window[-1])

    def window(self, index: int) -> np.ndarray:
        """Window ``index`` (``block_size + 1`` tokens) as an int64 copy."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"window {index} out of range for {n} windows")
        index %= n
        shard = int(np.searchsorted(self._first_window, index, side="right")) - 1
        start = (index - int(self._first_window[shard])) * self.block_size
        # np.array, not astype: a plain in-memory copy, never a view that keeps the map alive.
        return np.array(self.arrays[shard][start : start + self.block_size + 1], dtype=np.int64)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = torch.from_numpy(self.window(int(index)))
        return chunk[:-1], chunk[1:]

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """Windows ``indices`` stacked: an int64 array of shape ``(len(indices), block_size + 1)``."""
        out = np.empty((len(indices), self.block_size + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            out[row] = self.window(int(index))
        return out

    # --- epochs, batches and resumption ----------------------------------------------------------

    def global_order(self, epoch: int) -> np.ndarray:
        """Window indices of ``epoch`` in the order the whole job reads them."""
        if not self.shuffle:
            return np.arange(len(self))
        return np.random.default_rng([self.seed, int(epoch)]).permutation(len(self))

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next ``iter_batches``."""
        self.epoch, self.cursor = int(epoch), 0

    def _epoch_end(self, global_batch_size: int) -> int:
        """Windows handed out in a whole epoch, by the remainder policy of ``DistributedBatches``:
        a final partial global batch is kept when it splits evenly over the processes."""
        n = len(self)
        remainder = n % global_batch_size
        if remainder and (self.drop_remainder or remainder % self.data_parallel_size):
            return n - remainder
        return n

    def iter_batches(self, global_batch_size: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This process's ``(inputs, targets)`` for each remaining global batch of the current epoch.

        Starts at the cursor (0, or where ``load_state_dict`` left it); the cursor advances as
        each batch is handed out, so ``state_dict()`` taken after a step resumes at the next
        batch. At the end of the epoch the epoch number advances and the cursor returns to 0.
        ``global_batch_size`` defaults to the one of the loaded state.
        """
        gbs = self._resolve_batch_size(global_batch_size)
        end = self._epoch_end(gbs)
        if end < len(self) and self.cursor == 0 and not self.drop_remainder:
            warnings.warn(
                f"The last {len(self) - end} of {len(self)} windows are dropped each epoch: they do not "
                f"fill a global batch of {gbs} split over {self.data_parallel_size} processes.",
                stacklevel=2,
            )
        if self.cursor >= end:  # saved after the last batch of an epoch: continue with the next one
            self.set_epoch(self.epoch + 1)
        return self._batches(gbs, end)

    def _batches(self, gbs: int, end: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, order = self.epoch, self.global_order(self.epoch)
        while self.cursor < end and self.epoch == epoch:
            batch = order[self.cursor : min(self.cursor + gbs, end)]
            part = len(batch) // self.data_parallel_size
            mine = batch[self.data_index * part : (self.data_index + 1) * part]
            chunk = torch.from_numpy(self.windows(mine))
            self.cursor += len(batch)
            yield chunk[:, :-1], chunk[:, 1:]
        if self.epoch == epoch and self.cursor >= end:
            self.set_epoch(epoch + 1)

    def _resolve_batch_size(self, global_batch_size: int | None) -> int:
        gbs = self.global_batch_size if global_batch_size is None else int(global_batch_size)
        if gbs is None:
            raise ValueError("global_batch_size is needed (none was given and none was loaded). Received: None")
        if gbs < 1 or gbs % self.data_parallel_size:
            raise ValueError(
                f"global_batch_size must be a positive multiple of data_parallel_size="
                f"{self.data_parallel_size}. Received: global_batch_size={gbs}"
            )
        self.global_batch_size = gbs
        return gbs

    def state_dict(self) -> dict[str, Any]:
        """The job's position: identical on every process, so any rank's copy resumes the job."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "block_size": self.block_size,
            "global_batch_size": self.global_batch_size,
            "num_windows": len(self),
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off, with this dataset's number of processes."""
        missing = [k for k in ("seed", "epoch", "cursor", "block_size") if k not in state]
        if missing:
            raise ValueError(f"A TokenShardDataset state needs {missing}. Received: keys={sorted(state)}")
        if not 0 <= int(state["cursor"]) <= len(self):
            raise ValueError(f"cursor must be in [0, {len(self)}]. Received: cursor={state['cursor']}")
        if int(state["block_size"]) != self.block_size:
            raise ValueError(
                f"The state was saved with block_size={state['block_size']}, which cuts different "
                f"windows than this dataset's block_size={self.block_size}."
            )
        if "num_windows" in state and int(state["num_windows"]) != len(self):
            raise ValueError(
                f"The state was saved over {state['num_windows']} windows; {str(self.directory)!r} "
                f"has {len(self)}: a different corpus cannot resume exactly-once."
            )
        self.seed, self.epoch, self.cursor = int(state["seed"]), int(state["epoch"]), int(state["cursor"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.global_batch_size = state.get("global_batch_size")


def _read_index(directory: Path) -> dict[str, Any]:
    path = directory / INDEX_NAME
    if not path.is_file():
        hint = " (shards without an index: the writer did not finish)" if any(directory.glob("shard_*")) else ""
        raise ShardError(
            f"No {INDEX_NAME} in {str(directory)!r}{hint}; it is written last, when every shard is complete."
        )
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("format") not in FORMATS or index.get("dtype") not in ("uint16", "uint32"):
        raise ShardError(
            f"{str(path)!r}: unsupported format/dtype. Received: format={index.get('format')!r}, "
            f"dtype={index.get('dtype')!r}"
        )
    return index
