"""The Trainer's side of fault-tolerant replica groups: ``Trainer(..., fault_tolerance=ReplicaGroups(...))``.

The Trainer calls this at three points of each step and nowhere else:

1. ``position()`` before it fetches the step's batch: the data position (sampler epoch and cursor)
   the step starts from, kept so that a step that does not commit can hand its batch back;
2. ``begin_step(position)`` once it holds the batch: the synchronous quorum. A group that is behind
   (restarted, or new) receives the whole Trainer state from a live peer here, over trainmesh's
   pickle-free transport, and then fetches the peers' batch at their position;
3. ``commit()`` after backward: the gradients, scaled by this group's share of the batch, are
   averaged over the groups in the quorum with ``manager.allreduce`` (``ReplicaGroupSync``), and
   ``should_commit`` decides. On False nothing the step would change is changed: the Trainer skips
   optimizer, loss scaler, schedule, step counter, loss and history; this hook drops the step's
   metric updates and puts the data position back, so the same batch is the next step's.

Each group trains on its rows of every global batch (``share``): the quorum's rank r of n groups
takes rows [r*B/n, (r+1)*B/n). Its gradient is scaled by n*rows/B before the average, so the
committed update is the whole batch's mean gradient with 1 group or with n. In a group of several
processes each rank does this with its own rows of the batch (the group's data-parallel split comes
first), and the cross-group average is of each rank's gradient shard (``group_state``).

What a recovering group receives (tensors and plain types only, see ``tensor_codec``): model and
optimizer state, the schedule, the loss scaler, the step counter and epoch, the data position, the
history and torch's CPU RNG state.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from trainmesh.ft.replica_groups import ReplicaGroups, ReplicaGroupSync
from trainmesh.ft.shared_checkpoints import SharedCheckpoints


def check_fault_tolerance(fault_tolerance: Any) -> ReplicaGroups | None:
    """The Trainer's ``fault_tolerance=`` argument, checked before any process group or quorum exists."""
    if fault_tolerance is None:
        return None
    if not isinstance(fault_tolerance, ReplicaGroups):
        raise TypeError(
            f"fault_tolerance must be a trainmesh.ReplicaGroups or None. Received: {type(fault_tolerance).__name__}"
        )
    return fault_tolerance


def _row_count(batch: Any) -> int:
    if torch.is_tensor(batch):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _row_count(next(iter(batch.values())))
    return _row_count(batch[0])


def _rows(batch: Any, start: int, stop: int) -> Any:
    if torch.is_tensor(batch):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: _rows(v, start, stop) for k, v in batch.items()}
    return type(batch)(_rows(v, start, stop) for v in batch)


class TrainerReplicaGroups:
    """One Trainer's membership in the replica groups (built by ``fit``, shut down when it ends)."""

    def __init__(self, trainer: Any, config: ReplicaGroups):
        if trainer._steps is None or trainer._steps.sampler is None:
            raise ValueError(
                "fault_tolerance=ReplicaGroups(...) needs a map-style dataset (a torch Dataset or tensors) with "
                "fit(batch_size=...): a healed group and a step that did not commit resume at a sampler "
                f"position. Received: {type(getattr(trainer._steps, 'data', None)).__name__}"
            )
        self.trainer = trainer
        self._position: dict | None = None
        self._deferred: list[tuple[Any, Any]] = []
        self._scale = 1.0
        self.sync = ReplicaGroupSync(
            trainer.unwrapped_model,
            trainer.optimizer,
            config,
            scheduler=trainer.scheduler,
            extra_state=(self._trainer_state, self._load_trainer_state),
        )
        self.info = None
        self._first_quorum = True
        self.checkpoints = SharedCheckpoints(trainer, config.replica_group)
        if trainer.global_step:  # fit(resume=True) loaded a checkpoint: torchft counts from its step
            self.sync.manager.load_state_dict({"step": trainer.global_step, "batches_committed": 0})

    # --- the Trainer state beyond model, optimizer and schedule (ReplicaGroupSync sends those) ----
    def _trainer_state(self) -> dict[str, Any]:
        t = self.trainer
        scaler = t.precision.scaler
        return {
            "global_step": t.global_step,
            "epoch": t.epoch,
            # the position the step in progress started from, not the one after its fetch: the
            # receiver fetches this step's batch itself
            "data": self._position if self._position is not None else t._steps.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "history": t.history.state_dict(),
            "nonfinite_steps": t.nonfinite_steps,
            "rng": torch.get_rng_state(),
        }

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        t = self.trainer
        t.global_step, t.epoch, t.nonfinite_steps = state["global_step"], state["epoch"], state["nonfinite_steps"]
        t._steps.load_state_dict(state["data"])
        if t.precision.scaler is not None and state["scaler"] is not None:
            t.precision.scaler.load_state_dict(state["scaler"])
        t.history.load_state_dict(state["history"])
        torch.set_rng_state(state["rng"])

    # --- the three calls of a step ---------------------------------------------------------------
    def position(self) -> dict:
        """The data position before this step's fetch (a copy: the sampler moves on as it hands out)."""
        self._position = copy.deepcopy(self.trainer._steps.state_dict())
        return self._position

    def begin_step(self) -> bool:
        """The quorum; True when this group just received the live state (and so the peers' position)."""
        self.info = self.sync.begin_step()
        self._deferred.clear()
        self.checkpoints.set_writer(self.sync.manager.participating_rank())
        if self._first_quorum:
            self._first_quorum = False
            self.checkpoints.fresh_start_notice(self.info.step, self.info.healed)
        return self.info.healed

    def share(self, micro_batches: list) -> list:
        """This group's rows of each micro-batch; sets the gradient scale that makes the average exact."""
        n, r = self.info.num_replicas, self.info.replica_rank
        total = sum(_row_count(b) for b in micro_batches)
        mine = []
        for batch in micro_batches:
            rows = _row_count(batch)
            mine.append(_rows(batch, r * rows // n, (r + 1) * rows // n))
        own = sum(_row_count(b) for b in mine)
        self._scale = n * own / total if total else 1.0
        return mine

    def defer(self, update: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        """``on_outputs`` for forward: metric updates wait for the commit."""

        def keep(outputs: Any, targets: Any) -> None:
            self._deferred.append((outputs, targets))
            self._update = update

        return keep

    def commit(self) -> bool:
        """Average the gradients over the quorum, then ``should_commit``. On False the step's data
        position is restored, its metric updates dropped and its gradients zeroed."""
        self.sync.allreduce_gradients(scale=self._scale)
        committed = self.sync.manager.should_commit()
        if committed:
            for outputs, targets in self._deferred:
                self._update(outputs, targets)
        else:
            self.sync.uncommitted_steps += 1
            self.trainer._steps.load_state_dict(self._position)
            self.trainer.optimizer.zero_grad(set_to_none=True)
        self._deferred.clear()
        return committed

    def step_record(self) -> dict[str, Any]:
        """What the Trainer adds to a committed step's record (history, callbacks, log)."""
        return {
            "replicas": self.info.num_replicas,
            "healed": self.info.healed,
            "uncommitted_steps": self.sync.uncommitted_steps,
            "checkpoint_writer": self.checkpoints.writer,
        }

    def close(self) -> dict[str, int]:
        """Leave the quorum; returns the counters the Trainer keeps as ``replica_summary``."""
        summary = {
            "step": self.sync.current_step,
            "batches_committed": self.sync.batches_committed,
            "uncommitted_steps": self.sync.uncommitted_steps,
        }
        self.checkpoints.close()
        self.sync.shutdown()
        return summary
