"""The sparse-row half of ``PSClient``: ``pull_rows`` and ``push_rows`` on embedding tables.

A mixin, so a table's calls read as one concept apart from the dense path. It uses the client's
``params`` (the specs passed to ``init``), ``partitioner``, ``_owner`` (the cached placement-ring
lookup), ``io`` (the I/O thread's submit), ``clock_value``, ``worker_id``, ``server_ids``,
``_routers``, ``_track_push`` and ``_note_pull``, all set up by ``PSClient.__init__``. A push's rows
are routed to their owning servers by ``row_routing.RowRouter``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from .placement import shard_id
from .protocol import Message, MessageType
from .row_routing import RowRouter


class SparseRows:
    """``pull_rows`` / ``push_rows`` for ``PSClient`` (see the module docstring)."""

    def pull_rows(self, name: str, ids: torch.Tensor) -> Future:
        """Future of the rows ``ids`` of table ``name``, shape ``(len(ids), dim)``."""
        spec = self._table(name)
        unique, inverse = torch.unique(_check_ids(name, ids), return_inverse=True)
        clock = self.clock_value
        messages, placed = [], []
        for server, positions in self._router(name, spec).split_pull(unique):
            messages.append(
                (
                    server,
                    Message(
                        MessageType.PULL,
                        self.worker_id,
                        0,
                        tensors={"ids": unique[positions]},
                        meta={"clock": clock, "shards": [], "rows": {name: "ids"}},
                    ),
                )
            )
            placed.append(positions)

        def assemble(replies: list[Message]) -> torch.Tensor:
            self._note_pull(clock)
            rows = torch.empty(unique.numel(), spec["shape"][1])
            for positions, reply in zip(placed, replies):
                rows[positions] = reply.tensors[name]
            return rows[inverse]

        return self.io.submit(messages, assemble)

    def push_rows(self, name: str, ids: torch.Tensor, grads: torch.Tensor, *, lr: float | None = None) -> Future:
        """Send gradients of rows ``ids`` (duplicates summed); only those rows change on the servers."""
        spec = self._table(name)
        ids = _check_ids(name, ids)
        dim = spec["shape"][1]
        if not isinstance(grads, torch.Tensor) or tuple(grads.shape) != (ids.numel(), dim):
            raise ValueError(
                f"push_rows({name!r}): grads must have shape {(ids.numel(), dim)}, "
                f"got {tuple(grads.shape) if isinstance(grads, torch.Tensor) else type(grads).__name__}"
            )
        grads = grads.detach()
        if grads.dtype != torch.float32 or grads.device.type != "cpu":
            grads = grads.to("cpu", torch.float32)
        meta: dict[str, Any] = {"shards": [], "rows": {name: ["ids", "grads"]}, "round": self.clock_value}
        if lr is not None:
            meta["lr"] = float(lr)
        messages = [
            (server, Message(MessageType.PUSH, self.worker_id, 0, meta=dict(meta), tensors={"ids": i, "grads": g}))
            for server, i, g in self._router(name, spec).split_push(ids, grads, len(self.server_ids))
        ]
        return self._track_push(self.io.submit(messages))

    def _table(self, name: str) -> dict:
        spec = self.params.get(name)
        if spec is None or spec["kind"] != "sparse":
            raise ValueError(f"{name!r} is not a sparse table passed to init; known: {sorted(self.params)}")
        return spec

    def _router(self, name: str, spec: dict) -> RowRouter:
        router = self._routers.get(name)
        if router is None:
            rows, dim = spec["shape"]
            rows_per_shard = self.partitioner.rows_per_shard
            router = self._routers[name] = RowRouter(
                name, rows, dim, rows_per_shard, lambda index: self._owner(shard_id(name, index))
            )
        return router


def _check_ids(name: str, ids: Any) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"row ids for {name!r} must be an integer tensor, got {ids!r:.80}")
    return ids.reshape(-1).to("cpu", torch.int64)
