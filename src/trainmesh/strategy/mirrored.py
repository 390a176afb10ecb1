"""``MirroredStrategy`` and ``MultiWorkerMirroredStrategy``: TF's Strategy API as a thin
adapter over trainmesh's ``DataParallel``, one replica per process of the job.

The strategy owns a ``DataParallel`` (``strategy.distribution``), so anything that takes a
distribution (``scope()``, the Trainer) takes a strategy. The TF custom-loop pieces map to
torch like this:

============================================  =================================================
TF                                            trainmesh
============================================  =================================================
variables created in ``strategy.scope()``     parameters (and buffers) of modules built there:
                                              broadcast from replica 0 (see ``mirror.py``)
``optimizer.apply_gradients`` (SUM)           ``optimizer.step()`` SUMs mirrored gradients first
``tf.nn.compute_average_loss``                ``compute_average_loss`` (global batch scaling)
``strategy.run(fn, args)``                    ``fn(*args)`` on this process's replica
``strategy.reduce`` / ``strategy.gather``     collectives over all processes
``experimental_distribute_dataset``           this replica's contiguous slice of each global batch
============================================  =================================================

Two ways to train a model built in ``scope()``: a custom loop (``compute_average_loss``,
gradients SUMmed at ``optimizer.step()``); or wrap it in DDP, e.g. with
``strategy.distribution.distribute_model(model)`` or the Trainer, for a per-replica *mean*
loss: DDP averages the gradients in backward and the step hook then leaves those
parameters alone (it notices the wrapping), so nothing is reduced twice.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from trainmesh import runtime
from trainmesh.distribution import DataParallel
from trainmesh.distribution.mesh import device_index

from .input import DatasetFromFunction, DistributedDataset, InputContext
from .mirror import MirroredVariables
from .reduce import ReduceOp, gather_across_replicas, reduce_across_replicas

# Strategies whose scope is open, innermost last (process-wide, like the current distribution).
_open_scopes: list["MirroredStrategy"] = []


def _normalize_device(name: str) -> str:
    # Accept TF spellings too: "/gpu:0", "/device:GPU:0", "GPU:0" -> "gpu:0".
    return re.sub(r"^/?(device:)?", "", str(name)).lower()


class MirroredStrategy:
    """Synchronous data parallelism with one replica per process (TF ``tf.distribute.MirroredStrategy``).

    ``devices`` are Keras-style global names, one per process of the job (``"cpu:k"`` or
    ``"gpu:k"``; default ``tm.list_devices()``); their order is the replicas' order.

    >>> strategy = MirroredStrategy()          # one process: one replica
    >>> strategy.num_replicas_in_sync
    1
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(4, 2)      # mirrored: identical on every replica
    >>> strategy.run(lambda x: x * 2, args=(torch.ones(2),))
    tensor([2., 2.])
    >>> strategy.reduce("sum", torch.tensor([1.0, 2.0]), axis=0)
    tensor(3.)
    """

    def __init__(self, devices: Sequence[str] | None = None):
        if isinstance(devices, str):
            raise ValueError(f"devices must be a list of device names, not a string. Received: devices={devices!r}")
        names = [_normalize_device(d) for d in devices] if devices is not None else runtime.list_devices()
        indices = [device_index(name) for name in names]
        world = runtime.world_size()
        if sorted(indices) != list(range(world)):
            raise ValueError(
                f"MirroredStrategy runs one replica per process: devices must name each of the job's "
                f"{world} processes once (cpu:0..cpu:{world - 1} or gpu:0..gpu:{world - 1}). Received: devices={names}"
            )
        self._replica_ranks = indices  # replica i runs on process indices[i]
        self._mirror = MirroredVariables(
            src_rank=indices[0],
            num_replicas=len(indices),
            device=runtime.local_torch_device,
            ensure_group=self._ensure_group,
        )
        self._distribution = DataParallel(devices=names)

    # --- attributes -------------------------------------------------------------------------
    @property
    def distribution(self) -> DataParallel:
        """The underlying ``tm.DataParallel`` (what the Trainer and ``tm.distribution()`` see)."""
        return self._distribution

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._replica_ranks)

    @property
    def replica_id_in_sync_group(self) -> int:
        """This process's replica (TF asks ``get_replica_context()``; here one per process)."""
        return self._replica_ranks.index(runtime.rank())

    def _ensure_group(self) -> None:
        if self.num_replicas_in_sync > 1:
            runtime.initialize()  # idempotent; one process never needs a group at all

    # --- scope ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator["MirroredStrategy"]:
        """Make ``strategy.distribution`` current and mirror the parameters of modules built inside.

        On exit they are broadcast from replica 0 (and the registration hooks removed). On an
        exception every piece of state is restored and nothing built in the block is mirrored.
        Re-entering the same strategy nests; entering another strategy inside raises.
        """
        if _open_scopes and _open_scopes[-1] is not self:
            raise ValueError(
                "Mixing different strategies is not allowed: a scope of another strategy is open. "
                f"Received: strategy={self!r}, open={_open_scopes[-1]!r}"
            )
        _open_scopes.append(self)
        mark, completed = self._mirror.num_pending, False
        try:
            with self._distribution.scope(), self._mirror.capturing():
                yield self
            completed = True
        finally:
            _open_scopes.pop()
            if not completed:
                self._mirror.discard_pending(since=mark)
        self._mirror.flush()

    # --- replica computation ------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None, options: Any = None
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` as this process's replica; returns its per-replica result."""
        if not callable(fn):
            raise TypeError(f"strategy.run needs a callable. Received: fn={fn!r}")
        self._mirror.flush()  # parameters built in a still-open scope are mirrored before first use
        with self._distribution.scope():  # compute_average_loss sees num_replicas_in_sync
            return fn(*tuple(args), **(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine per-replica values: SUM or MEAN over replicas, and along ``axis`` when given
        (MEAN over the global element count, exact with uneven sizes). Same result everywhere."""
        self._ensure_group()
        return reduce_across_replicas(reduce_op, value, axis, self.num_replicas_in_sync)

    def gather(self, value: Any, axis: int) -> torch.Tensor:
        """Concatenate every replica's tensor along ``axis`` in replica order (sizes may differ)."""
        self._ensure_group()
        return gather_across_replicas(value, axis, self._replica_ranks)

    def experimental_local_results(self, value: Any) -> tuple:
        """The values held by this process's replicas: one replica per process."""
        return (value,)

    def aggregate_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """SUM the mirrored gradients of ``optimizer`` now, e.g. to clip the global gradient:

        >>> strategy.aggregate_gradients(optimizer)                          # doctest: +SKIP
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)          # doctest: +SKIP
        >>> optimizer.step()   # does not reduce again                       # doctest: +SKIP

        (Clipping before ``step()`` without it clips each replica's partial gradient, as in
        TF's replica context.)
        """
        self._mirror.aggregate(optimizer)

    # --- input ------------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset: Iterable, options: Any = None) -> DistributedDataset:
        """Iterate this replica's contiguous slice of every global batch of ``dataset``.

        ``dataset`` yields global batches (e.g. ``DataLoader(batch_size=global_batch_size)``),
        identical on every process (seed shuffling identically). A global batch that does
        not divide evenly gives the first ``B % N`` replicas one more example (TF's rebatching).
        """
        return DistributedDataset(
            dataset,
            self.num_replicas_in_sync,
            self.replica_id_in_sync_group,
            device=runtime.local_torch_device(),
            on_iter=self._mirror.flush,
        )

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable], options: Any = None
    ) -> DatasetFromFunction:
        """Build one input pipeline per replica: ``dataset_fn(InputContext)`` must return
        per-replica batches (``ctx.get_per_replica_batch_size(global_batch_size)``) and shard by
        ``ctx.input_pipeline_id``; the same number of batches on every replica."""
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable. Received: dataset_fn={dataset_fn!r}")
        context = InputContext(
            num_input_pipelines=self.num_replicas_in_sync,
            input_pipeline_id=self.replica_id_in_sync_group,
            num_replicas_in_sync=self.num_replicas_in_sync,
        )
        return DatasetFromFunction(dataset_fn(context), device=runtime.local_torch_device(), on_iter=self._mirror.flush)

    # --- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the strategy's hooks; parameters keep their values but are no longer mirrored.

        Optional: without it the step hook removes itself at the first optimizer step after
        every mirrored parameter has been garbage-collected.
        """
        self._mirror.close()

    def __repr__(self) -> str:
        devices = self._distribution.device_mesh.devices.ravel().tolist()
        return f"<{type(self).__name__} num_replicas_in_sync={self.num_replicas_in_sync}, devices={devices}>"


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """``MirroredStrategy`` over every process of a multi-host job (TF ``MultiWorkerMirroredStrategy``).

    Joins the job first with ``tm.initialize()``, which reads ``TF_CONFIG`` (or torchrun's /
    Slurm's variables). To pass explicit settings, call ``tm.initialize(...)`` before it.
    """

    def __init__(self) -> None:
        runtime.initialize()
        super().__init__(devices=None)
