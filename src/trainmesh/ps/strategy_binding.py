"""Binding a model and its optimizer to the parameter servers, for ``ParameterServerStrategy``:
collecting the model's trainable dense parameters and ``PSEmbedding`` tables, registering them
(worker 0's values win), and keeping the local dense copies in step with the servers after each
step (a pull every step when a served parameter is sync, else the SSP cache of dense_cache.py).

A mixin apart from strategy.py because it is the model's side of the strategy (which parameters
live where, and how their local copies are refreshed), while strategy.py keeps the construction,
the modes, the scope and the custom-loop API. It uses the strategy's ``client``, ``mode_of``,
``worker_id``, ``num_workers``, ``_distribution``, ``_dense``, ``_tables``, ``_served``,
``dense_cache`` and ``_optimizers``, all set by ``ParameterServerStrategy.__init__``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from trainmesh import runtime

from .dense_cache import DenseCache
from .embedding import PSEmbedding
from .param_entries import dense_param, table_param
from .worker_optimizer import PSOptimizer, server_optimizer_spec, spec_for_mode


class ModelBinding:
    """The strategy's model and optimizer on the servers (see the module docstring)."""

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
