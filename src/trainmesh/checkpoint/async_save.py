"""A save in flight: DCP writes in a background thread, the commit waits for every rank.

``dcp.async_save`` blocks only while it stages a CPU copy of the state (so training may
overwrite parameters right away); planning, writing and DCP's metadata happen in a thread
on the checkpoint's own gloo group. Nothing here touches the training group from that
thread. The commit (marker + rename) is *not* done from the thread either: a rank only
knows its own write finished, so the ranks agree from their main threads, with one small
collective, that every write succeeded, and only then rank 0 seals the directory. They ask
at every step boundary while a save is in flight (``CheckpointManager.poll``, or the step's
own all-reduce through ``CommitRider``), so a save is committed as soon as the slowest rank's
bytes are on disk, not at the next save.

A deadline bounds how long a save stays uncommitted: ``commit_within_steps`` step boundaries
after the save, a rank waits for its own write before it answers. With 1 (the default) the
write overlaps one training step and is committed at its end, so a crash loses at most one
checkpoint interval: after step ``s + 1`` the checkpoint of step ``s`` is always on disk.

A write that fails (a full disk, a file size limit) is agreed on at the same point: every
rank hears it, the failure is reported with the path and the free space, the half-written
directory is removed and the previous checkpoint is kept (retention prunes only after a
commit). Errors that are not about the disk (a state that cannot be saved) still raise.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# Outcomes agreed on with one MIN all-reduce: the worst rank's wins.
FAILED, WRITE_FAILED, OK = 0, 1, 2


@dataclass
class PendingSave:
    step: int
    tmp_dir: str
    final_dir: str
    info: dict[str, Any]
    future: Future | None = None
    started: float = field(default_factory=time.perf_counter)
    asks: int = 0  # step boundaries that asked whether every write is done

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

    def ask(self, deadline: int | None) -> bool:
        """Whether this rank's write is done, waiting for it when the deadline has come."""
        self.asks += 1
        if deadline is not None and self.asks >= deadline:
            self.wait_local()
        return self.done()


def failed_future(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future


def is_write_error(exc: BaseException | None) -> bool:
    """An OSError (ENOSPC, EFBIG, EROFS, ...), directly, as one rank's failure in DCP's
    ``CheckpointException`` (which carries every failed rank's exception), or behind the error it
    caused (``torch.save``'s zip writer fails with a RuntimeError while handling the OSError)."""
    for link in _chain(exc):
        if isinstance(link, OSError):
            return True
        failures = getattr(link, "failures", None)
        if isinstance(failures, dict) and failures:
            return all(isinstance(pair[0] if isinstance(pair, tuple) else pair, OSError) for pair in failures.values())
    return False


def _chain(exc: BaseException | None):
    """``exc``, then the error it was raised from or while handling, and so on (each once: a chain
    can loop when an error is re-raised while handling itself)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def outcome(error: BaseException | None) -> int:
    return OK if error is None else WRITE_FAILED if is_write_error(error) else FAILED


def agree(code: int, group) -> int:
    """The smallest ``code`` over the ranks of ``group`` (one all-reduce; identical everywhere)."""
    if group is None or not dist.is_initialized():
        return code
    flag = torch.tensor([code], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item())


def all_ranks_ok(ok: bool, group) -> bool:
    """True when every rank of ``group`` reports ``ok`` (one all-reduce; identical answer everywhere)."""
    return agree(OK if ok else FAILED, group) == OK


def all_ranks_finished(pending: PendingSave, group, deadline: int | None = None) -> bool:
    """True when every rank's write of ``pending`` has finished (one 1-int all-reduce).

    ``group`` must not be the one the writes run on: a rank still writing has DCP collectives
    in flight on that group from its background thread, and ours would interleave with them.
    """
    return all_ranks_ok(pending.ask(deadline), group)


def free_bytes(path: str) -> int | None:
    """Bytes free to an unprivileged writer on the file system of ``path`` (or its nearest parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def _unwrap(failure) -> BaseException:
    return failure[0] if isinstance(failure, tuple) else failure


def _disk_cause(exc: BaseException) -> BaseException:
    """The OSError behind ``exc`` where there is one (the message a user can act on), else ``exc``."""
    return next((link for link in _chain(exc) if isinstance(link, OSError)), exc)


def _errors_by_rank(error: BaseException | None, rank: int) -> dict[int, str]:
    if error is None:
        return {}
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:  # DCP's, raised on every rank: the ranks that failed
        found = {int(r): _disk_cause(_unwrap(f)) for r, f in failures.items()}
    else:
        found = {rank: _disk_cause(error)}
    return {r: f"{type(e).__name__}: {e}" for r, e in found.items()}


def failure_message(step: int, tmp_dir: str, error: BaseException | None, group, kept: str | None) -> str:
    """What went wrong on which rank, where, how much space is left, and what was kept (collective:
    the ranks' errors are gathered, so the message names a failure on any of them)."""
    distributed = group is not None and dist.is_initialized()
    mine = _errors_by_rank(error, dist.get_rank(group) if distributed else 0)
    gathered = [mine]
    if distributed:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
    failed = dict(sorted({r: text for errors in gathered for r, text in errors.items()}.items()))
    free = free_bytes(tmp_dir)
    space = "unknown" if free is None else f"{free / 2**20:.1f} MiB ({free} bytes)"
    detail = "; ".join(f"rank {rank}: {text}" for rank, text in failed.items()) or "no error recorded"
    previous = f"the previous checkpoint {kept} is kept" if kept else "there is no earlier checkpoint"
    return (
        f"Checkpoint of step {step} was not saved: writing {tmp_dir} failed ({detail}). "
        f"Free space there: {space}. Nothing was committed, {previous}, and training continues."
    )
