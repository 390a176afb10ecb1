"""Which server owns each row of a push or pull, and a push's rows split per server.

A table's rows are split into ranges of ``rows_per_shard`` rows placed on the hash ring; a push of
1,024 random ids into a 1M-row table touches ~250 ranges. ``RowRouter`` hashes each range once
(``owner(range)``, the client's cached ring lookup) and keeps the owners in an array, so routing a
batch is a few array ops. The index arithmetic is done in NumPy on views of the ids: on 1,024
elements a NumPy op costs a microsecond or two where a torch op costs 5-15 (the dispatcher, and
each call hands the GIL to the client's I/O thread), and a push made ~15 of them. Only the
gradient rows, the bulk of the bytes, are moved by torch (one gather).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch


class RowRouter:
    """The owning server of every row range of one table (``rows`` rows, ``dim`` wide)."""

    def __init__(self, name: str, rows: int, dim: int, rows_per_shard: int, owner: Callable[[int], int]):
        self.name, self.rows, self.dim, self.rows_per_shard = name, rows, dim, rows_per_shard
        self._owner = owner  # range index -> server index (hashes the range's shard id)
        self._owner_of_range = np.full(-(-rows // rows_per_shard), -1, dtype=np.int64)  # -1: not hashed yet

    def servers_of(self, ids: np.ndarray) -> np.ndarray:
        """The server index owning each row of ``ids`` (int64; checked in range first)."""
        if ids.size:
            low, high = int(ids.min()), int(ids.max())
            for row in (low, high):
                if not 0 <= row < self.rows:
                    raise ValueError(f"row id {row} out of range for table {self.name!r} with {self.rows} rows")
        ranges = ids // self.rows_per_shard
        server_of_row = self._owner_of_range[ranges]
        if ids.size and server_of_row.min() < 0:
            for index in np.unique(ranges[server_of_row < 0]).tolist():
                self._owner_of_range[index] = self._owner(index)
            server_of_row = self._owner_of_range[ranges]
        return server_of_row

    def split_pull(self, unique: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``[(server, positions into unique)]`` for the servers owning the rows ``unique``."""
        if unique.numel() == 0:
            return []
        server_of_row = self.servers_of(unique.numpy())
        return [
            (server, torch.from_numpy(np.flatnonzero(server_of_row == server)))
            for server in np.unique(server_of_row).tolist()
        ]

    def split_push(
        self, ids: torch.Tensor, grads: torch.Tensor, num_servers: int
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``[(server, its ids, its gradient rows)]``: each server's ids distinct and increasing,
        a duplicate id's gradients summed (in the order given, as ``index_add_`` sums them).

        One sort by (owning server, id): each server's rows come out contiguous and in id order,
        so its ids and rows are slices of one gather, not a gather per server."""
        ids_np = ids.numpy()
        key = self.servers_of(ids_np) * self.rows + ids_np
        order = np.argsort(key, kind="stable")
        keys = key[order]
        if keys.size < 2 or bool((keys[1:] > keys[:-1]).all()):
            # No id twice (the usual batch of distinct rows): one gather, no sum into a zeroed buffer.
            summed = grads.index_select(0, torch.from_numpy(order))
        else:
            keys, inverse = np.unique(key, return_inverse=True)  # (inverse: in the grads' order)
            summed = torch.zeros(keys.size, self.dim).index_add_(0, torch.from_numpy(inverse.reshape(-1)), grads)
        servers = keys // self.rows
        unique = torch.from_numpy(keys - servers * self.rows)
        out, start = [], 0
        for server, count in enumerate(np.bincount(servers, minlength=num_servers).tolist()):
            if count:
                out.append((server, unique[start : start + count], summed[start : start + count]))
                start += count
        return out
