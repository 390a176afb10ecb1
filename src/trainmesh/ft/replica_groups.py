"""Replica groups that survive the loss of one of them: torchft's Lighthouse and Manager under trainmesh's step.

A replica group is one process or several (its own torch.distributed world, any layout inside:
``group_state``); a Lighthouse keeps the quorum of the groups that are alive, and each process's
``torchft.Manager`` joins it once per step (rank r of every group is paired with rank r of the
others: the replicate dimension of HSDP). Per step:

1. ``begin_step``: a synchronous quorum (torchft's asynchronous one races an FSDP2 forward); a group
   that is behind (restarted, or new) receives the live state from a peer *before* its forward;
2. the user's forward and backward;
3. ``finish_step``: the gradients are flattened into one bucket per dtype and averaged over the groups
   alive at this step with ``manager.allreduce`` (trainmesh's own step: torchft's DDP wrapper crashes
   the survivor when a peer dies mid-all-reduce); ``should_commit`` then gates the optimizer step,
   the learning-rate schedule and the step counter. A step whose all-reduce failed is not committed
   anywhere, and its gradients are dropped.

The state a recovering group receives goes over the groups' own gloo process group as a JSON header
plus raw tensor bytes (``tensor_codec``): nothing a peer sends is unpickled.

>>> sync = ReplicaGroupSync(model, optimizer, ReplicaGroups(replica_group=0, lighthouse=url))  # doctest: +SKIP
>>> while sync.current_step < 100:                                                            # doctest: +SKIP
...     info = sync.begin_step()          # quorum; heals this group from a peer if it is behind
...     loss_fn(model(batch_for(info))).backward()
...     committed = sync.finish_step()    # cross-group average, then should_commit gates optimizer.step
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch

from trainmesh.ft.binding import bind_address, manager_server_bound_to, wait_for_lighthouse
from trainmesh.ft.group_state import group_store, load_model_local, load_optimizer_local, local, local_tree
from trainmesh.ft.membership import QuorumWatch, replica_id_for
from trainmesh.ft.replica_config import ReplicaGroups, torchft_available
from trainmesh.ft.state_transport import SafeStateTransport

__all__ = ["ReplicaGroups", "ReplicaGroupSync", "StepInfo", "SafeStateTransport", "torchft_available"]


@dataclass(frozen=True)
class StepInfo:
    """What ``begin_step`` tells the step: which committed step this is, and this group's share of it."""

    step: int  # committed steps so far (every live group agrees after begin_step)
    replica_rank: int  # this group's rank among the groups in this step's quorum
    num_replicas: int  # groups in this step's quorum
    healed: bool  # this group just received the live state from a peer
    left: tuple[int | None, ...] = ()  # groups in the previous step's quorum and not in this one (named on stderr)


def _group_rank_world() -> tuple[int, int]:
    """This process's rank and the size of its replica group (the group's own torch.distributed world)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ValueError(
            f"a replica group of several processes needs its process group initialized first (the Trainer does "
            f"it; else torch.distributed.init_process_group). Received: WORLD_SIZE={world}, no process group"
        )
    return 0, 1


class ReplicaGroupSync:
    """One replica group's side of the fault-tolerant step (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ReplicaGroups,
        *,
        scheduler: Any = None,
        extra_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
    ):
        if not isinstance(config, ReplicaGroups):
            raise TypeError(f"config must be a ReplicaGroups. Received: {type(config).__name__}")
        if not torchft_available():
            raise ImportError("ReplicaGroups needs torchft: pip install 'trainmesh[ft]'")
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        self.model, self.optimizer, self.scheduler, self.config = model, optimizer, scheduler, config
        self._extra_state = extra_state
        timeout = timedelta(seconds=config.timeout_s)
        group_rank, group_world = _group_rank_world()
        # This group's store, served by its rank 0: the Manager finds its group's manager server there,
        # and the quorum's gloo groups rendezvous in the first member's store.
        self._store, host, port = group_store(config.advertise_host, timeout)
        self._pg = ProcessGroupGloo(timeout=timeout)
        # torchft would bind its Manager server on every interface: bind it where the group's store is
        # the Lighthouse retried every lighthouse_retry_s at most (see binding): more, shorter retries
        retries = max(config.quorum_retries, math.ceil(config.quorum_timeout_s / config.lighthouse_retry_s))
        self.lighthouse_retries = retries
        wait_for_lighthouse(config.lighthouse, config.connect_timeout_s)
        with manager_server_bound_to(
            bind_address(host),
            connect_timeout=timedelta(seconds=config.lighthouse_retry_s),
            quorum_retries=retries,
        ):
            self.manager = Manager(
                pg=self._pg,
                load_state_dict=self._load_state,
                state_dict=self._state,
                min_replica_size=config.min_replicas,
                use_async_quorum=False,  # synchronous: a healed group has the live state before its forward
                timeout=timeout,
                quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
                connect_timeout=timedelta(seconds=config.connect_timeout_s),
                rank=group_rank,  # a group of several processes: torchft pairs rank r of every group
                world_size=group_world,
                store_addr=host,
                store_port=port,
                lighthouse_addr=config.lighthouse,
                replica_id=replica_id_for(config.replica_group, host),  # the host too: a group that leaves is named
                hostname=host,
                heartbeat_interval=timedelta(seconds=config.heartbeat_interval_s),
                checkpoint_transport=SafeStateTransport(self._pg, timeout),
                init_sync=True,
                quorum_retries=config.quorum_retries,
            )
        self._watch = QuorumWatch(self.manager, group_world, announce=group_rank == 0)
        self._healed = False
        self.uncommitted_steps = 0

    # --- the state a recovering group receives (tensors and plain types only) ---------------
    def _state(self) -> dict[str, Any]:
        # each rank sends its shards: the same rank of the recovering group holds the same ones
        state = {"model": local_tree(self.model.state_dict()), "optimizer": local_tree(self.optimizer.state_dict())}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self._extra_state is not None:
            state["extra"] = self._extra_state[0]()
        return state

    def _load_state(self, state: dict[str, Any]) -> None:
        load_model_local(self.model, state["model"])
        load_optimizer_local(self.optimizer, state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self._extra_state is not None and "extra" in state:
            self._extra_state[1](state["extra"])
        self._healed = True

    # --- the step ------------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        """Committed steps so far; a healed group takes the live groups' count."""
        return self.manager.current_step()

    @property
    def batches_committed(self) -> int:
        return self.manager.batches_committed()

    def begin_step(self) -> StepInfo:
        self._healed = False
        self.manager.start_quorum()  # synchronous: returns with the quorum formed and any healing applied
        rank = self.manager.participating_rank()
        step = self.manager.current_step()
        left = self._watch.left(step)
        return StepInfo(
            step=step,
            replica_rank=0 if rank is None else rank,
            num_replicas=max(1, self.manager.num_participants()),
            healed=self._healed,
            left=tuple(group.group for group in left),
        )

    def allreduce_gradients(self, scale: float = 1.0) -> None:
        """Average every gradient over this step's groups: one flat bucket per dtype, one
        ``manager.allreduce`` each. A failure is recorded by the manager (``should_commit`` says no).
        ``scale`` multiplies this group's gradients first (its share of an unevenly split batch)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            if p.grad is None:  # a parameter unused this step: zeros, so every group's bucket matches
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            # this rank's shards only (ZeRO inside the group): the same rank of each group holds the same
            grads = [local(p.grad) for p in group]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if scale != 1.0:
                flat.mul_(scale)
            self.manager.allreduce(flat).wait()
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def finish_step(self) -> bool:
        """All-reduce, then commit (optimizer, schedule, step counter) only if every group agrees."""
        started = time.monotonic()
        self.allreduce_gradients()
        error = self.manager.errored()  # kept to say why a group that leaves the next quorum left
        self._watch.note_error(None if error is None else error.original_exception, time.monotonic() - started)
        committed = self.manager.should_commit()
        if committed:
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        else:
            self.uncommitted_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return committed

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
