"""``ParameterServerStrategy``: train a model whose parameters live on parameter servers
(TF's ``tf.distribute.experimental.ParameterServerStrategy``, on trainmesh's Trainer).

Per optimizer step each of the N workers: forward/backward on its slice of the global batch
(split like ``DataParallel``); ``step()`` pushes its dense gradients and its ``PSEmbedding``
row gradients (with the current lr), calls ``clock()``, and pulls fresh dense values. The
servers apply every push with their optimizer, which mirrors the user's torch optimizer.

Gradient convention: each worker pushes ``(1/N) * gradient of its mean local loss``; the sum
of a round's pushes is the gradient of the mean loss over the global batch. With
``mode="sync"`` the servers sum a round's pushes and apply the sum once, when every worker has
clocked past it (``sync_rounds.py``, TF's ``SyncReplicasOptimizer``): SGD, momentum, Adam,
AdamW and Adagrad take exactly the steps of one process training on the full global batch.
Async/SSP parameters apply each push as it arrives (their ``weight_decay`` is sent as
``weight_decay / N``: decay about once per N pushes); a round of N pushes moves the model about
as far as one synchronous step.

Consistency (``mode``): ``"sync"`` (BSP: a pull waits until every worker finished the previous
step), ``"ssp"`` (at most ``staleness`` steps ahead of the slowest worker), ``"async"`` (never
waits). Per parameter: a dict of ``fnmatch`` patterns, first match wins, e.g.
``mode={"emb.*": "async", "*": "sync"}``; a value may carry its own bound: ``"ssp:2"``.
A ``PSEmbedding``'s own ``mode=`` overrides the pattern for its table.

Servers: ``TRAINMESH_PS_SERVERS`` (comma-separated, set by ``trainmesh run --servers K``), else
``servers=[addresses]``, else ``num_servers`` (default 1) local server processes started by
worker 0 (addresses shared over the process group), stopped at ``close()`` or exit.
Secret (every server authenticates every frame): ``secret=``, else ``TRAINMESH_PS_SECRET`` or
``TRAINMESH_PS_SECRET_FILE``, else the random one worker 0 made for the servers it started, sent
to the other workers with their addresses (see auth.py).
Buffers (e.g. BatchNorm statistics) and frozen parameters stay on the workers.

With the Trainer, workers still meet at its per-step loss all-reduce (``nonfinite_loss`` check,
``log_every_n_steps=1``); for async/SSP workers to run apart, pass ``nonfinite_loss=None`` and a
large ``log_every_n_steps``, or write a custom loop (``strategy.prepare``).

Connecting to the servers (their addresses and secret, the local ones worker 0 starts) is in
strategy_servers.py, binding a model and its optimizer to them (registration, the pulls after a
step) in strategy_binding.py; this module keeps the construction, the modes, the scope and the
custom-loop API.
"""

from __future__ import annotations

import contextlib
import fnmatch
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from trainmesh import runtime
from trainmesh.distribution.distribution import Distribution
from trainmesh.distribution.layout import TensorLayout
from trainmesh.distribution.mesh import DeviceMesh

from .dense_cache import DenseCache
from .embedding import PSEmbedding
from .param_entries import parse_mode
from .durability import DURABILITY
from .strategy_binding import ModelBinding
from .strategy_servers import SERVERS_ENV, ServerConnection  # noqa: F401 - SERVERS_ENV is imported from here too
from .worker_optimizer import PSOptimizer

_open_scopes: list["ParameterServerStrategy"] = []


def current_strategy() -> "ParameterServerStrategy | None":
    """The strategy whose ``scope()`` is open (innermost), if any."""
    return _open_scopes[-1] if _open_scopes else None


class PSDistribution(Distribution):
    """The strategy as a trainmesh ``Distribution``: data split over the workers like
    ``DataParallel`` (axis ``"batch"``), parameters on the servers."""

    def __init__(self, strategy: "ParameterServerStrategy", devices: Sequence[str]):
        mesh = DeviceMesh(shape=(len(devices),), axis_names=["batch"], devices=list(devices))
        super().__init__(mesh, batch_dim_name="batch")
        self.strategy = strategy

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        from trainmesh.distribution.distribution import variable_path_and_shape

        _, shape = variable_path_and_shape(variable)
        return TensorLayout((None,) * len(shape), self.device_mesh)

    def distribute_model(self, model: nn.Module) -> nn.Module:
        """Bind ``model`` to the servers (returned unwrapped); values are registered and pulled
        by ``prepare_optimizer``, when the server optimizer is known."""
        self.strategy.bind_model(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> PSOptimizer:
        """Register the model with the servers (worker 0's values win), pull, and return the
        proxy whose ``step()`` pushes, clocks and pulls."""
        return self.strategy.bind_optimizer(optimizer, model)


class ParameterServerStrategy(ServerConnection, ModelBinding):
    """Data-parallel workers, parameters on K parameter servers (see the module docstring).

    >>> strategy = ParameterServerStrategy(num_servers=2, mode="sync")           # doctest: +SKIP
    >>> trainer = tm.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...                      loss, distribution=strategy)                        # doctest: +SKIP
    >>> model, optimizer = strategy.prepare(model, optimizer)   # a custom loop  # doctest: +SKIP

    ``client_options`` go to every worker's ``PSClient`` (identical on all workers: they decide
    placement), e.g. ``{"rows_per_shard": 65536}``: fewer, larger row ranges make a push that
    touches rows all over a big table cheaper. Other keywords go to ``LocalCluster`` when the
    strategy starts the servers itself.
    """

    def __init__(
        self,
        num_servers: int | None = None,
        servers: Sequence[str] | None = None,
        mode: str | dict[str, str] = "async",
        staleness: int | None = None,
        durability: str = "none",
        compression: str | None = None,
        *,
        secret: bytes | str | None = None,
        client_options: dict[str, Any] | None = None,
        **server_options: Any,
    ):
        if num_servers is not None and (
            isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1
        ):
            raise ValueError(f"num_servers must be a positive int. Received: num_servers={num_servers!r}")
        if isinstance(servers, str):
            raise ValueError(f"servers must be a list of addresses, not a string. Received: servers={servers!r}")
        if servers is not None and not list(servers):
            raise ValueError(f"servers must name at least one address. Received: servers={servers!r}")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be 'none', 'snapshot' or 'wal'. Received: durability={durability!r}")
        self._modes = dict(mode) if isinstance(mode, dict) else {"*": mode}
        if not self._modes:
            raise ValueError(f"mode patterns must not be empty. Received: mode={mode!r}")
        self._resolved = {pattern: parse_mode(value, staleness) for pattern, value in self._modes.items()}
        self.num_servers, self.servers = num_servers, list(servers) if servers is not None else None
        self.durability, self.compression, self.secret = durability, compression, secret
        self.server_options = server_options  # LocalCluster's (dead_after_s, directory, ...)
        self.client_options = dict(client_options or {})  # PSClient's (rows_per_shard, part_numel, ...)
        runtime.initialize()  # idempotent: torchrun's group, or a one-process group
        self.num_workers, self.worker_id = runtime.world_size(), runtime.rank()
        self._distribution = PSDistribution(self, [f"cpu:{i}" for i in range(self.num_workers)])
        self._client = None
        self._cluster = None  # LocalCluster started by this process (worker 0), if any
        self._started_secret: bytes | None = None  # that cluster's secret, on every worker
        self._dense: dict[str, nn.Parameter] = {}
        self._tables: dict[str, PSEmbedding] = {}
        self._served: list[str] = []  # dense parameters registered on the servers
        self.dense_cache: DenseCache | None = None  # set at registration when no served parameter is sync
        self._optimizers: list[PSOptimizer] = []  # flushed at close(): their pipelined pushes

    # --- attributes ---------------------------------------------------------------------------
    @property
    def distribution(self) -> PSDistribution:
        """What the Trainer and ``tm.distribution()`` see."""
        return self._distribution

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers

    @property
    def client(self):
        """This worker's ``PSClient`` (connects, starting local servers if needed, on first use)."""
        if self._client is None:
            self._connect()
        return self._client

    def mode_of(self, name: str) -> tuple[str, int | None]:
        """``(mode, staleness)`` of parameter ``name``: the first matching pattern's."""
        for pattern, resolved in self._resolved.items():
            if fnmatch.fnmatchcase(name, pattern):
                return resolved
        raise ValueError(
            f"No mode pattern matches parameter {name!r}; add a catch-all '*'. Received: mode={self._modes!r}"
        )

    # --- scope and the custom-loop API (as MirroredStrategy) -------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator["ParameterServerStrategy"]:
        """Make ``strategy.distribution`` current; ``PSEmbedding`` built inside use this strategy."""
        _open_scopes.append(self)
        try:
            with self._distribution.scope():
                yield self
        finally:
            _open_scopes.remove(self)

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        """Run ``fn(*args, **kwargs)`` as this worker (one replica per process)."""
        if not callable(fn):
            raise TypeError(f"strategy.run needs a callable. Received: fn={fn!r}")
        with self._distribution.scope():
            return fn(*tuple(args), **(kwargs or {}))

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """SUM or MEAN of per-worker values over the workers (a collective: every worker calls it)."""
        from trainmesh.strategy.reduce import reduce_across_replicas

        return reduce_across_replicas(reduce_op, value, axis, self.num_workers)

    def experimental_distribute_dataset(self, dataset: Iterable) -> Iterable:
        """This worker's contiguous slice of every global batch of ``dataset`` (as MirroredStrategy)."""
        from trainmesh.strategy.input import DistributedDataset

        return DistributedDataset(dataset, self.num_workers, self.worker_id, device=runtime.local_torch_device())

    def stats(self) -> dict:
        """This worker's client counters and every server's (bytes, pushes, clocks, staleness)."""
        return self.client.stats().result()

    def close(self) -> None:
        """Wait for this worker's pipelined pushes (SSP/async), disconnect; worker 0 stops the
        servers it started once every worker got here."""
        self._close(raise_errors=True)

    def _close(self, raise_errors: bool) -> None:
        try:
            for optimizer in self._optimizers:
                optimizer.flush(raise_errors)  # a refused push is raised after the teardown below
        finally:
            self._optimizers = []
            self._disconnect()

    def _disconnect(self) -> None:
        with contextlib.suppress(RuntimeError):
            runtime.barrier()  # a no-op on one process
        client, self._client = self._client, None
        if client is not None:
            client.close()
        self._stop_cluster()

    def __enter__(self) -> "ParameterServerStrategy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close(raise_errors=exc[0] is None)  # never mask the error that is leaving the block

    def __repr__(self) -> str:
        return (
            f"<ParameterServerStrategy workers={self.num_workers}, mode={self._modes!r}, "
            f"servers={self.servers or self.num_servers}>"
        )
