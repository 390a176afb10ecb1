"""``PSEmbedding``: an embedding table that lives on the parameter servers.

The worker never holds the table. ``forward(ids)`` pulls only the distinct rows the batch
touches into a leaf tensor (``requires_grad``) and looks them up through the inverse index,
so autograd leaves the rows' gradients on that leaf. ``push_gradients()`` (called by the
strategy's optimizer proxy at ``step()``) sends those row gradients to the servers, which
update only those rows. Traffic per step is proportional to the touched rows, not the table.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .param_entries import MODES, register_table


class PSEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with its table on the parameter servers.

    ``name`` is the table's key on the servers (unique per job). ``client`` is a
    ``PSClient``; by default the ``ParameterServerStrategy`` the model is distributed with
    (or whose ``scope()`` is open at construction) provides it. Rows start as
    ``normal(0, init_std)`` drawn on the servers (``init_std=0``: zeros). ``mode`` and
    ``staleness`` override the strategy's consistency for this table (see the strategy).
    ``optimizer`` is the servers' optimizer config for an explicit ``client`` (default plain
    SGD, lr 0.01); under the strategy it mirrors the torch optimizer's first group.

    >>> emb = PSEmbedding(1_000_000, 16, name="emb.item")            # doctest: +SKIP
    >>> vectors = emb(torch.tensor([[3, 7], [7, 9]]))  # pulls rows 3, 7, 9 only  # doctest: +SKIP
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        name: str,
        client: Any = None,
        init_std: float = 0.01,
        mode: str | None = None,
        staleness: int | None = None,
        optimizer: dict | None = None,
    ):
        super().__init__()
        for label, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PSEmbedding {label} must be a positive int. Received: {label}={value!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"PSEmbedding needs a non-empty string name (its key on the servers). Received: name={name!r}"
            )
        if not isinstance(init_std, (int, float)) or not math.isfinite(init_std) or init_std < 0:
            raise ValueError(f"PSEmbedding init_std must be a finite number >= 0. Received: init_std={init_std!r}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"PSEmbedding mode must be 'sync', 'ssp', 'async' or None. Received: mode={mode!r}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.name = name
        self.init_std = float(init_std)
        self.mode, self.staleness = mode, staleness
        self._client = client
        self._registered = False
        self.server_optimizer = dict(optimizer) if optimizer is not None else {"name": "sgd", "lr": 0.01}
        # (unique ids, leaf rows) of every training forward since the last push: gradient
        # accumulation over micro-batches pushes them together.
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pushed_rows = 0  # rows whose gradients were pushed so far (for tests and logs)
        from .strategy import current_strategy  # late: strategy imports this module

        self._strategy = current_strategy()

    # --- wiring --------------------------------------------------------------------------
    def attach(self, client: Any, *, registered: bool) -> None:
        """Called by the strategy: use ``client``; ``registered`` when it already created the table."""
        self._client = client
        self._registered = registered

    @property
    def client(self) -> Any:
        if self._client is None and self._strategy is not None:
            self._strategy.attach_embedding(self)
        if self._client is None:
            raise RuntimeError(
                f"PSEmbedding {self.name!r} has no parameter-server client: pass client=..., build it inside "
                "ParameterServerStrategy.scope(), or distribute its model with the strategy."
            )
        if not self._registered:
            register_table(self._client, self)
            self._registered = True
        return self._client

    def register(self) -> None:
        """Create the table on the servers now (otherwise: at the first forward)."""
        self.client  # noqa: B018 -- the property registers

    # --- forward -------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(
                f"PSEmbedding {self.name!r} takes an integer tensor of ids. "
                f"Received: {type(ids).__name__}{'' if not torch.is_tensor(ids) else ' of ' + str(ids.dtype)}"
            )
        unique, inverse = torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True)  # sorted
        if unique.numel():
            low, high = int(unique[0]), int(unique[-1])
            if low < 0 or high >= self.num_embeddings:
                raise ValueError(
                    f"PSEmbedding {self.name!r} has {self.num_embeddings} rows; ids must be in "
                    f"[0, {self.num_embeddings}). Received: ids in [{low}, {high}]"
                )
        rows = self.client.pull_rows(self.name, unique).result()
        rows = rows.to(torch.float32).reshape(len(unique), self.embedding_dim)
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._pending.append((unique, rows))
        return nn.functional.embedding(inverse, rows).reshape(*ids.shape, self.embedding_dim)

    # --- backward -> servers ---------------------------------------------------------------
    def row_gradients(self, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(ids, gradients)`` of the rows touched since the last push, each id once
        (micro-batches summed), times ``scale``; ``None`` when nothing was touched."""
        pending = [(ids, rows.grad) for ids, rows in self._pending if rows.grad is not None]
        self._pending = []
        if not pending:
            return None
        if len(pending) == 1:
            ids, grad = pending[0]
        else:
            all_ids = torch.cat([ids for ids, _ in pending])
            ids, inverse = torch.unique(all_ids, return_inverse=True)
            grad = torch.zeros(len(ids), self.embedding_dim, dtype=pending[0][1].dtype)
            grad.index_add_(0, inverse, torch.cat([g for _, g in pending]))
        return ids, grad * scale if scale != 1.0 else grad

    def push_gradients(self, *, scale: float = 1.0, lr: float | None = None):
        """Push the touched rows' gradients (times ``scale``); returns the push future or ``None``.

        ``lr`` (the worker's current learning rate) overrides the servers' configured one."""
        found = self.row_gradients(scale)
        if found is None:
            return None
        ids, grad = found
        self.pushed_rows += len(ids)
        return self.client.push_rows(self.name, ids, grad.detach(), lr=lr)

    def zero_grad_rows(self) -> None:
        """``optimizer.zero_grad()`` for the pulled rows (they are not parameters). The rows stay
        pending: ``forward; zero_grad(); backward(); step()`` must still push them."""
        for _, rows in self._pending:
            rows.grad = None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, name={self.name!r}, on parameter servers"
