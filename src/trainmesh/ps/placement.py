"""Where parameters live: shard ids, their key ranges, and which server owns each shard.

Every client and server computes the same placement from the same list of server ids, so no
placement table is ever sent. Hashing uses blake2b (never Python's per-process ``hash()``).
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Iterable, NamedTuple, Sequence


__all__ = [
    "DenseShardSpec",
    "HashRing",
    "Partitioner",
    "RowShardSpec",
    "moved_shards",
    "ring_hash",
    "shard_id",
    "split_shard_id",
]


def ring_hash(key: str) -> int:
    """First 8 bytes of blake2b(key), big endian: the position of ``key`` on the ring."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8")).digest()[:8], "big")


def shard_id(name: str, index: int) -> str:
    """The id of part ``index`` of parameter ``name``."""
    return f"{name}#{index}"


def split_shard_id(sid: str) -> tuple[str, int | None]:
    """``(name, index)`` of a ``shard_id``; index None where ``sid`` is not ``name#<digits>``
    (name ``""`` where it has no ``#``)."""
    name, sep, index = sid.rpartition("#")
    return name, (int(index) if sep and index.isdigit() else None)


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a non-empty str, got {name!r}")
    return name


def _check_count(value: object, what: str, minimum: int) -> int:
    # bool is an int subclass; True as a row count is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


class HashRing:
    """Consistent-hash ring with ``virtual_nodes`` points per server.

    Immutable: ``add`` and ``remove`` return a new ring, so the old and new placements can be
    compared with ``moved_shards`` during rebalancing.
    """

    def __init__(self, server_ids: Sequence[str], virtual_nodes: int = 64):
        if isinstance(server_ids, str):
            raise TypeError(f"server_ids must be a sequence of str, got the str {server_ids!r}")
        servers = [_check_name(s, "server id") for s in server_ids]
        if not servers:
            raise ValueError("HashRing needs at least one server id, got none")
        if len(set(servers)) != len(servers):
            dupes = sorted({s for s in servers if servers.count(s) > 1})
            raise ValueError(f"duplicate server ids: {dupes}")
        self._virtual_nodes = _check_count(virtual_nodes, "virtual_nodes", 1)
        self._servers = tuple(servers)
        # Sorting on (hash, server) breaks the (astronomically unlikely) hash ties the same way
        # in every process, whatever order the servers were listed in.
        points = sorted(
            (ring_hash(f"{server}#vn{i}"), server) for server in servers for i in range(self._virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [s for _, s in points]

    @property
    def servers(self) -> tuple[str, ...]:
        return self._servers

    @property
    def virtual_nodes(self) -> int:
        return self._virtual_nodes

    def owner(self, shard: str) -> str:
        """The server owning ``shard``: the first ring point clockwise from its hash."""
        _check_name(shard, "shard id")
        i = bisect.bisect_right(self._hashes, ring_hash(shard))
        return self._owners[i % len(self._owners)]

    def owners(self, shards: Iterable[str]) -> dict[str, str]:
        return {s: self.owner(s) for s in shards}

    def add(self, server: str) -> "HashRing":
        """A new ring with ``server`` added."""
        if server in self._servers:
            raise ValueError(f"server {server!r} is already on the ring {list(self._servers)}")
        return HashRing([*self._servers, server], self._virtual_nodes)

    def remove(self, server: str) -> "HashRing":
        """A new ring without ``server``."""
        if server not in self._servers:
            raise ValueError(f"server {server!r} is not on the ring {list(self._servers)}")
        if len(self._servers) == 1:
            raise ValueError(f"cannot remove {server!r}: it is the ring's only server")
        return HashRing([s for s in self._servers if s != server], self._virtual_nodes)

    def __repr__(self) -> str:
        return f"HashRing({list(self._servers)!r}, virtual_nodes={self._virtual_nodes})"


def moved_shards(old_ring: HashRing, new_ring: HashRing, shard_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``{shard_id: (old_owner, new_owner)}`` for the shards whose owner changed."""
    moved = {}
    for s in shard_ids:
        old, new = old_ring.owner(s), new_ring.owner(s)
        if old != new:
            moved[s] = (old, new)
    return moved


class DenseShardSpec(NamedTuple):
    """Part of a flattened dense parameter: elements ``[start, stop)``."""

    shard_id: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class RowShardSpec(NamedTuple):
    """Row range ``[row_start, row_stop)`` of a sparse table."""

    shard_id: str
    row_start: int
    row_stop: int

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start


class Partitioner:
    """Splits dense parameters into flat parts and sparse tables into row ranges."""

    def __init__(self, part_numel: int = 262144, rows_per_shard: int = 4096):
        self.part_numel = _check_count(part_numel, "part_numel", 1)
        self.rows_per_shard = _check_count(rows_per_shard, "rows_per_shard", 1)

    def dense_shards(self, name: str, numel: int) -> list[DenseShardSpec]:
        """Parts of ``part_numel`` elements; the last may be shorter. An empty parameter still
        gets one (empty) part so every parameter has at least one shard to pull."""
        _check_name(name, "parameter name")
        _check_count(numel, f"numel of {name!r}", 0)
        if numel == 0:
            return [DenseShardSpec(shard_id(name, 0), 0, 0)]
        return [
            DenseShardSpec(shard_id(name, i), start, min(start + self.part_numel, numel))
            for i, start in enumerate(range(0, numel, self.part_numel))
        ]

    def sparse_shards(self, name: str, rows: int, dim: int) -> list[RowShardSpec]:
        """Row ranges of ``rows_per_shard`` rows; the last may be shorter."""
        _check_name(name, "table name")
        _check_count(rows, f"rows of table {name!r}", 1)
        _check_count(dim, f"dim of table {name!r}", 1)
        return [
            RowShardSpec(shard_id(name, i), start, min(start + self.rows_per_shard, rows))
            for i, start in enumerate(range(0, rows, self.rows_per_shard))
        ]
