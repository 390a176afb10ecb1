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
"""

from __future__ import annotations

import atexit
import contextlib
import fnmatch
import math
import os
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from trainmesh import runtime
from trainmesh.distribution.distribution import Distribution
from trainmesh.distribution.layout import TensorLayout
from trainmesh.distribution.mesh import DeviceMesh

from .dense_cache import DenseCache
from .embedding import PSEmbedding
from .param_entries import dense_param, parse_mode, table_param
from .durability import DURABILITY
from .auth import resolve_secret
from .worker_optimizer import PSOptimizer, server_optimizer_spec, spec_for_mode

SERVERS_ENV = "TRAINMESH_PS_SERVERS"
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


class ParameterServerStrategy:
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

    # --- servers ------------------------------------------------------------------------------
    def _connect(self) -> None:
        from .client import PSClient

        addresses = self._server_addresses()
        self._client = PSClient(
            servers=addresses,
            worker_id=self.worker_id,
            num_workers=self.num_workers,
            secret=self._secret_bytes(),
            compression=self.compression,
            **self.client_options,
        )

    def _secret_bytes(self) -> bytes | None:
        """``secret=``, else the job's (``TRAINMESH_PS_SECRET``, set by ``trainmesh run --servers``,
        or ``TRAINMESH_PS_SECRET_FILE``), else the one worker 0 made for the servers it started."""
        return resolve_secret(self.secret) or self._started_secret

    def _server_addresses(self) -> list[str]:
        raw = os.environ.get(SERVERS_ENV, "")
        if raw.strip():  # checked at the door: a bad port, empty host or repeat is named before any connection
            from trainmesh.runtime.addresses import parse_server_list

            return parse_server_list(raw, name=SERVERS_ENV)
        if self.servers is not None:
            return list(self.servers)
        holder: list[Any] = [None]
        if self.worker_id == 0:
            try:
                holder[0] = self._start_local_servers()
            except Exception as error:  # the others must not wait forever in the broadcast
                holder[0] = f"error: {type(error).__name__}: {error}"
        if self.num_workers > 1:
            import torch.distributed as dist

            # The servers' secret (a new one unless the user gave one) goes only to the job's own
            # processes, over their process group, with the addresses.
            dist.broadcast_object_list(holder, src=0)
        if isinstance(holder[0], str):
            raise RuntimeError(f"worker 0 could not start the parameter servers ({holder[0]})")
        addresses, secret = holder[0]
        self._started_secret = secret.encode("utf-8")
        return list(addresses)

    def _start_local_servers(self) -> tuple[list[str], str]:
        from .cluster import LocalCluster

        self._cluster = LocalCluster(
            self.num_servers or 1,
            num_workers=self.num_workers,
            durability=self.durability,
            secret=resolve_secret(self.secret),
            **self.server_options,
        )
        atexit.register(self._stop_cluster)
        return list(self._cluster.addresses), self._cluster.secret

    def _stop_cluster(self) -> None:
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.stop()

    # --- binding a model ------------------------------------------------------------------------
    def bind_model(self, model: nn.Module) -> None:
        """Collect ``model``'s trainable dense parameters and ``PSEmbedding`` tables."""
        tables = [m for m in model.modules() if isinstance(m, PSEmbedding)]
        names = [t.name for t in tables]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"Two PSEmbedding tables share a name; names are server keys. Received: {duplicates}")
        dense = {name: p for name, p in model.named_parameters() if p.requires_grad}
        clash = sorted(set(dense) & set(names))
        if clash:
            raise ValueError(f"A PSEmbedding name equals a parameter name: {clash}")
        for name in list(dense) + names:
            self.mode_of(name)  # every parameter needs a mode before anything is sent
        self.client  # noqa: B018 -- connect now: on every worker, in the same order of collectives
        self._dense.update(dense)
        for table in tables:
            self._tables[table.name] = table
            table.attach(self.client, registered=False)

    def attach_embedding(self, table: PSEmbedding) -> None:
        """A table built in ``scope()`` and used before its model was distributed."""
        self._tables.setdefault(table.name, table)
        table.attach(self.client, registered=False)

    def bind_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> PSOptimizer:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer. Received: {type(optimizer).__name__}")
        names_by_id = {id(p): n for n, p in self._dense.items()}
        groups = []
        for group in optimizer.param_groups:
            unknown = [p for p in group["params"] if id(p) not in names_by_id and p.requires_grad]
            if unknown:
                raise ValueError(
                    "The optimizer holds parameters that are not the distributed model's; build it "
                    f"from model.parameters(). Received: {len(unknown)} unknown parameter(s)"
                )
            spec = server_optimizer_spec(optimizer, group)  # weight decay per mode: see _register
            groups.append((spec, [names_by_id[id(p)] for p in group["params"] if id(p) in names_by_id]))
        table_spec = groups[0][0] if groups else server_optimizer_spec(optimizer, optimizer.param_groups[0])
        self._register(groups, table_spec)
        proxy = PSOptimizer(optimizer, self, groups, list(self._tables.values()))
        self._optimizers.append(proxy)
        return proxy

    def _register(self, groups: list[tuple[dict, list[str]]], table_optimizer: dict) -> None:
        """Worker 0 creates every key first (its values win), then the others declare the same
        keys (acknowledged, not applied), then everybody pulls."""
        params = []
        self._served = [name for _, names in groups for name in names]  # not the optimizer's: stays local
        for spec, names in groups:
            for name in names:
                mode, staleness = self.mode_of(name)
                params.append(
                    dense_param(
                        name, self._dense[name].detach(), spec_for_mode(spec, mode, self.num_workers), mode, staleness
                    )
                )
        for table in self._tables.values():
            entry = table_param(table, self)
            table.server_optimizer = entry["optimizer"] = spec_for_mode(
                table_optimizer, entry["mode"], self.num_workers
            )
            params.append(entry)
        client = self.client  # connecting may be a collective: before the barriers below
        if self.worker_id != 0:
            runtime.barrier()
        client.init(params)
        if self.worker_id == 0:
            runtime.barrier()
        for table in self._tables.values():
            table.attach(self.client, registered=True)
        modes = [self.mode_of(name) for name in self._served]
        if modes and all(mode != "sync" for mode, _ in modes):
            # SSP/async: a bounded-staleness copy, so step() need not wait for a pull every step.
            staleness = min(math.inf if s is None else s for _, s in modes)
            self.dense_cache = DenseCache(self.client, self._served, self._dense, staleness)
            self.dense_cache.load()
        else:
            self.dense_cache = None
            self.pull_dense()

    def pull_dense(self) -> None:
        """Overwrite the local dense parameters with the servers' values (waits for them)."""
        if not self._served:
            return
        values = self.client.pull(self._served).result()
        with torch.no_grad():
            for name in self._served:
                param = self._dense[name]
                param.copy_(values[name].reshape(param.shape).to(param.dtype))

    def refresh_dense(self) -> None:
        """After a step: the servers' values when any served parameter is sync, else values
        within the SSP bound, pulled only when the cached copy is too old (``dense_cache.py``)."""
        if self.dense_cache is None:
            self.pull_dense()
        else:
            self.dense_cache.refresh()

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, PSOptimizer]:
        """For a custom loop: ``model, optimizer = strategy.prepare(model, optimizer)``."""
        model = self._distribution.distribute_model(model)
        return model, self._distribution.prepare_optimizer(optimizer, model)

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
