"""``CheckpointManager``: sharded save (sync or async), commit, keep last k + best, latest, load.

Layout of one checkpoint ``<dir>/step_00000123/``::

    dcp/            model + optimizer, torch.distributed.checkpoint shards (each rank its own); without
                    frozen parameters unless ``save_frozen`` (the marker lists what it holds)
    rank_00000.pt   per-rank extras: RNG states, data-loader state ("data"), compressor residuals ("compression")
    shared.pt       rank 0: other stateful objects (scheduler, scaler, ...) and plain values
                    (both hold tensors and plain values only: they load with ``weights_only=True``)
    meta.json       the plain values again, human-readable
    COMPLETE.json   written LAST: files + sha256, step, world size, layout, metrics

Every method except ``latest``/``best``/``checkpoints`` is collective: all ranks call it.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch.distributed as dist

from .. import runtime
from .._torch import dcp as _dcp
from .._torch import trainable_state
from . import integrity, retention, rng
from .single_file import save_plain
from . import async_save as _async
from .async_save import PendingSave, all_ranks_finished
from .commit_rider import CommitRider
from .manager_reads import CheckpointReads
from .state_split import PER_RANK_KEYS, _layout_info, _split

FORMAT_VERSION = integrity.FORMAT_VERSION


class CheckpointManager(CheckpointReads):
    """Sharded, crash-safe checkpoints under ``directory``. Constructing it is collective.

    >>> manager = CheckpointManager("ckpt", keep_last=3, keep_best=("val_loss", "min"))   # doctest: +SKIP
    >>> manager.save(step, {"model": model, "optimizer": opt, "trainer": {"epoch": 2}})  # doctest: +SKIP
    >>> meta = manager.load("latest", {"model": model, "optimizer": opt})                # doctest: +SKIP

    ``save_frozen=False`` (the default): a model with frozen parameters (``requires_grad=False``: the
    base of a LoRA fine-tune) is saved without them; loading expects them built as the first start
    built them, and the same parameters trainable (checked, with the tensors named).

    ``commit_within_steps`` (async): at the ``n``-th :meth:`poll` after a save, each rank waits for
    its own write, so the save is committed by then (polled once a step, 1 commits it at the end
    of the step after the save: a crash loses at most one save interval; the Trainer's
    ``ShardedCheckpoint`` does so); None (here the default) never waits before the next save.
    A save whose write fails on the disk (full, a size limit, read-only) is not committed; every
    rank hears it, a warning names the path, each failed rank's error and the free space, the
    previous checkpoint is kept, and ``failures`` lists the messages; other errors raise.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last: int = 3,
        keep_best: Any = None,
        async_save: bool = False,
        verify_checksums: bool = True,
        save_frozen: bool = False,
        commit_within_steps: int | None = None,
    ):
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1. Received: keep_last={keep_last!r}")
        if commit_within_steps is not None and (
            isinstance(commit_within_steps, bool) or not isinstance(commit_within_steps, int) or commit_within_steps < 1
        ):
            raise ValueError(
                f"commit_within_steps must be an int >= 1 or None. Received: commit_within_steps={commit_within_steps!r}"
            )
        self.commit_within_steps = commit_within_steps
        self.failures: list[str] = []  # one message per save that failed to write (see class doc)
        self.directory = os.fspath(directory)
        self.keep_last = keep_last
        self.keep_best = retention.resolve_keep_best(keep_best)
        self.async_save = bool(async_save)
        self.verify_checksums = verify_checksums
        self.save_frozen = bool(save_frozen)
        self._fingerprints: dict = {}  # the frozen base's, computed once (trainable_state.manifest)
        self.last_blocking_s: float | None = None  # how long the last save() held the caller
        self._pending: PendingSave | None = None
        self._distributed = dist.is_available() and dist.is_initialized()
        self._group = _dcp.new_checkpoint_group()
        self._stager = _dcp.ReusableStager() if self.async_save else None
        # poll() asks on a group of its own: the save's group is busy in the writer thread.
        # (Unless a step's all-reduce already carried the question: see commit_rider.)
        self._poll_group = _dcp.new_checkpoint_group() if self.async_save else None
        self._heard: tuple[PendingSave, bool] | None = None  # (save asked about, all ranks done)

    # --- save ---------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, metrics: dict[str, float] | None = None) -> str | None:
        """Save ``state`` as step ``step``; returns the final directory (committed now, or at a later
        ``poll``/``save``/``wait``/``close`` when ``async_save``), or None when the write failed
        (reported; the previous checkpoint is kept)."""
        start = time.perf_counter()
        model, optimizer, per_rank, shared, plain = _split(state)
        self.wait()  # the previous async save commits first: saves commit in order
        final_dir = os.path.join(self.directory, integrity.step_dirname(step))
        tmp_dir = final_dir + integrity.TMP_SUFFIX
        rank, world = runtime.rank(), runtime.world_size()
        error = None
        if rank == 0:
            retention.remove_partial(self.directory)
            error = _guard_disk(lambda: os.makedirs(tmp_dir))
        self._barrier()
        if error is None:
            error = _guard_disk(lambda: self._write_extras(tmp_dir, rank, per_rank, shared, plain))
        # Before any DCP collective: a rank whose small files failed must not leave the others
        # planning a write it will never join.
        if self._agree(error) != _async.OK:
            self._abandon(int(step), tmp_dir, error)
            return None
        info = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "world_size": world,
            "time": time.time(),
            "metrics": {k: float(v) for k, v in (metrics or {}).items()},
            "layout": _layout_info(model, optimizer),
            "has_optimizer": optimizer is not None,
            "per_rank": sorted(per_rank),
            "shared": sorted(shared),
        }
        pending = PendingSave(int(step), tmp_dir, final_dir, info)
        if model is not None:
            contents = trainable_state.manifest(model, self.save_frozen, self._group, self._fingerprints)
            info["model_tensors"] = contents  # read first at load: which tensors to expect
            sharded = _dcp.sharded_state(model, optimizer, frozen=contents["frozen_saved"])
            dcp_dir = os.path.join(tmp_dir, "dcp")
            if self.async_save:
                pending.future = _dcp.async_save(sharded, dcp_dir, self._group, self._stager)
            else:
                try:
                    _dcp.save(sharded, dcp_dir, self._group)
                except BaseException as exc:  # noqa: BLE001 - DCP raised it on every rank; wait() decides
                    pending.future = _async.failed_future(exc)
        self._pending = pending
        committed = final_dir
        if not self.async_save:
            committed = self.wait()
        self.last_blocking_s = time.perf_counter() - start
        return committed

    def _write_extras(self, tmp_dir: str, rank: int, per_rank: dict, shared: dict, plain: dict) -> None:
        extras = {"rng": rng.capture(), **{k: v.state_dict() for k, v in per_rank.items()}}
        save_plain(extras, os.path.join(tmp_dir, f"rank_{rank:05d}.pt"), what=f"per-rank extras {sorted(extras)}")
        if rank == 0:
            save_plain(
                {"stateful": {k: v.state_dict() for k, v in shared.items()}, "plain": plain},
                os.path.join(tmp_dir, "shared.pt"),
                what=f"shared state {sorted(shared) + sorted(plain)}",
            )
            integrity.write_json_atomic(os.path.join(tmp_dir, "meta.json"), plain)

    def wait(self) -> str | None:
        """Finish and commit the save in flight, if any (collective); returns its directory, or
        None when there was none or its write failed (reported; the previous checkpoint is kept)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error = pending.wait_local()
        if self._agree(error) != _async.OK:
            self._abandon(pending.step, pending.tmp_dir, error)
            return None
        if runtime.rank() == 0:
            # The marker is written last: a full disk here leaves an uncommitted directory only.
            error = _guard_disk(lambda: integrity.seal(pending.tmp_dir, pending.final_dir, pending.info))
            if error is None:
                retention.prune(self.directory, self.keep_last, self.keep_best)
        if self._agree(error) != _async.OK:  # also the barrier: nobody goes on before the commit
            self._abandon(pending.step, pending.tmp_dir, error)
            return None
        return pending.final_dir

    def _agree(self, error: BaseException | None) -> int:
        """Every rank's outcome -> the worst; a non-disk error raises on every rank."""
        code = _async.agree(_async.outcome(error), self._group if self._distributed else None)
        if code == _async.FAILED:
            if error is not None and not _async.is_write_error(error):
                raise error
            raise RuntimeError("A checkpoint save failed on another rank (its error is raised there).")
        return code

    def _abandon(self, step: int, tmp_dir: str, error: BaseException | None) -> None:
        """A write failed somewhere: report it (collective), remove the partial directory, keep the rest."""
        kept = None
        if runtime.rank() == 0:
            entries = retention.complete_entries(self.directory)
            kept = entries[-1].path if entries else None
        message = _async.failure_message(step, tmp_dir, error, self._group if self._distributed else None, kept)
        message = self._broadcast(message)  # rank 0's: it knows what is kept
        if runtime.rank() == 0:
            retention.remove_partial(self.directory)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.failures.append(message)
        self._barrier()

    finalize = wait

    def poll(self) -> str | None:
        """Commit the save in flight if every rank's write has finished; else return at once.

        Collective: every rank calls it at the same point (the Trainer's ``ShardedCheckpoint``
        does at every step boundary). With nothing in flight it does nothing and sends nothing;
        otherwise it costs one 1-int all-reduce, plus the commit once the writes are done. At the
        ``commit_within_steps``-th poll after a save it waits for this rank's write first.
        Returns the committed directory, or None (not yet, or the write failed: see ``failures``).
        """
        if self._pending is None:
            return None
        heard, self._heard = self._heard, None
        if heard is not None and heard[0] is self._pending:
            all_done = heard[1]  # from this step's own all-reduce: nothing more to send
        else:
            all_done = all_ranks_finished(self._pending, self._poll_group, self.commit_within_steps)
        if not all_done:
            return None
        return self.wait()  # every write is done: it does not block, and reports a failed one

    def commit_rider(self) -> "CommitRider":
        """An object for :func:`trainmesh.trainer.loss_tracking.add_rider`: the question
        :meth:`poll` asks ("is every rank's write done?") then rides on the step's all-reduce,
        and ``poll`` right after that step sends nothing of its own."""
        return CommitRider(self)

    def close(self) -> None:
        self.wait()

    # --- helpers ------------------------------------------------------------------------
    def _barrier(self) -> None:
        if self._distributed and self._group is not None:
            dist.barrier(group=self._group)

    def _rank0_decides(self, decide):
        """``decide()`` on rank 0, its result (or its error, raised) on every rank."""
        value = None
        if runtime.rank() == 0:
            try:
                value = decide()
            except Exception as exc:  # noqa: BLE001 - raised below on every rank, none left waiting
                value = exc
        value = self._broadcast(value)
        if isinstance(value, Exception):
            raise value
        return value

    def _broadcast(self, value):
        if not (self._distributed and self._group is not None):
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


def _guard_disk(write) -> BaseException | None:
    """Run ``write``; a disk error is returned to be agreed on, anything else raises."""
    try:
        write()
    except Exception as exc:  # noqa: BLE001 - only disk errors are kept (see is_write_error)
        if not _async.is_write_error(exc):
            raise
        return exc
    return None


__all__ = ["CheckpointManager", "CommitRider", "PER_RANK_KEYS", "FORMAT_VERSION"]
