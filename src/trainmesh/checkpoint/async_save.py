"""A save in flight: DCP writes in a background thread, the commit waits for every rank.

``dcp.async_save`` blocks only while it stages a CPU copy of the state (so training may
overwrite parameters right away); planning, writing and DCP's metadata happen in a thread
on the checkpoint's own gloo group. Nothing here touches the training group from that
thread. The commit (marker + rename) is *not* done from the thread either: a rank only
knows its own write finished, so the ranks agree from their main threads, with one small
collective, that every write succeeded, and only then rank 0 seals the directory. They ask
at every step boundary while a save is in flight (``CheckpointManager.poll``), so a save is
committed as soon as the slowest rank's bytes are on disk, not at the next save: a crash
between saves then loses at most one checkpoint interval.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class PendingSave:
    step: int
    tmp_dir: str
    final_dir: str
    info: dict[str, Any]
    future: Future | None = None
    started: float = field(default_factory=time.perf_counter)

    def done(self) -> bool:
        """This rank's write finished (not yet committed; no collective)."""
        return self.future is None or self.future.done()

    def wait_local(self) -> BaseException | None:
        """Block until this rank's write finished; the error it raised, if any."""
        if self.future is None:
            return None
        try:
            self.future.result()
        except BaseException as exc:  # noqa: BLE001 - reported after the ranks agree
            return exc
        return None


def all_ranks_ok(ok: bool, group) -> bool:
    """True when every rank of ``group`` reports ``ok`` (one all-reduce; identical answer everywhere)."""
    if group is None or not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def all_ranks_finished(pending: PendingSave, group) -> bool:
    """True when every rank's write of ``pending`` has finished (one 1-int all-reduce).

    ``group`` must not be the one the writes run on: a rank still writing has DCP collectives
    in flight on that group from its background thread, and ours would interleave with them.
    """
    return all_ranks_ok(pending.done(), group)
