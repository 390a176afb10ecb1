"""What one parameter server holds: parameter specs, shards, the dedup table, durability.

``ParameterServer`` (server.py) runs the loop and the protocol; this module changes and reads
the state. Every mutation (init, push, import) goes through ``ServerState`` so a WAL replay on
restart takes exactly the path a live request took. The dedup table (dedup.py), the spec checks
(spec_checks.py) and moving shards out and in (shard_moves.py) are in modules of their own.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Callable

import torch

from .dedup import DedupTable
from .placement import shard_id, split_shard_id
from .protocol import Message
from .row_store import RowStore
from .shard import Shard
from .shard_moves import ShardMoves
from .spec_checks import _check_spec, _staleness
from .sync_rounds import SNAPSHOT_KEY, OpenRounds

log = logging.getLogger(__name__)


class ServerState(ShardMoves):
    """Specs, shards and dedup table of one server, with their durability (see ``durability``)."""

    def __init__(self, durability: str, directory, secret, snapshot_every: int, snapshot_every_s: float):
        self.durability = durability
        self.secret = secret
        self.params: dict[str, dict] = {}
        self.shards: dict[str, Shard] = {}
        self.dedup = DedupTable()
        self._decompressors: dict[str, Any] = {}
        self._row_stores: dict[str, RowStore] = {}  # sparse table -> the ranges held here, packed
        # Advanced whenever a shard in ``shards`` is replaced or removed (a restore, an import,
        # an export that removes): while it stays the same, a row store trusts the ranges it
        # packed and looks up only new ones (RowStore._rows), instead of every touched range.
        self.shards_generation = 0
        self.rounds = OpenRounds()  # sync pushes waiting for their round (sync_rounds.py)
        self.store = None
        if durability != "none":
            from .durability import DurableStore

            self.store = DurableStore(
                os.fspath(directory),
                secret,
                log_pushes=durability == "wal",
                snapshot_every=snapshot_every,
                snapshot_every_s=snapshot_every_s,
            )

    # -- durability -------------------------------------------------------------------------

    def recover(self, mutate: Callable[[Message], None]) -> int:
        """Load the last snapshot, then replay the log through ``mutate``; returns records replayed."""
        if self.store is None:
            return 0
        snapshot = self.store.load_snapshot()
        if snapshot is not None:
            meta, shards = snapshot
            self.params = meta["params"]
            self.dedup.load_json(meta["dedup"])
            self.rounds.closed_below = int(meta.get("closed_below", 0))
            open_rounds = [shards.pop(key) for key in sorted(shards) if key.startswith(SNAPSHOT_KEY)]
            if open_rounds:
                self.rounds.load_chunks(open_rounds)
            self.shards = {sid: Shard.from_state(tensors, shard_meta) for sid, (tensors, shard_meta) in shards.items()}
            self.shards_generation += 1
        return self.store.replay(mutate)

    def log_then(self, frame: bytes, apply: Callable[[], None]) -> None:
        """Make ``frame`` durable first (WAL), then apply it; an ack may follow."""
        if self.store is not None:
            self.store.log(frame)
        apply()
        if self.store is not None:
            self.store.count_update()

    def maybe_snapshot(self, force: bool = False) -> None:
        if self.store is None or not (force or self.store.snapshot_due()):
            return
        try:
            shards = {sid: shard.state_dict() for sid, shard in self.shards.items()}
            if self.rounds:  # acknowledged pushes of open rounds: the log is truncated after this
                shards.update({f"{SNAPSHOT_KEY}{i}": chunk for i, chunk in enumerate(self.rounds.state_chunks())})
            self.store.write_snapshot(
                {
                    "params": self.params,
                    "dedup": self.dedup.to_json(),
                    "time": time.time(),
                    "closed_below": self.rounds.closed_below,
                },
                shards,
            )
        except OSError as error:  # e.g. disk full: the WAL (kept until a snapshot succeeds) still holds everything
            log.error("snapshot to %s failed, will retry: %s", self.store.directory, error)
            self.store.retry_at = time.monotonic() + 5.0

    def close(self) -> None:
        if self.store is not None:
            self.maybe_snapshot(force=True)
            self.store.close()

    # -- init and shards ----------------------------------------------------------------------

    def prepare_init(self, msg: Message) -> Callable[[], None]:
        """Check an init completely; the returned call creates what is new (first init wins)."""
        specs = msg.meta.get("params")
        if not isinstance(specs, list) or not all(
            isinstance(s, dict) and isinstance(s.get("name"), str) for s in specs
        ):
            raise ValueError(f"init meta 'params' must be a list of specs with names, got {specs!r:.200}")
        for spec in specs:
            _check_spec(spec)
            known = self.params.get(spec["name"])
            if known is not None and known != spec:
                raise ValueError(
                    f"parameter {spec['name']!r} was already created with a different spec: {known} != {spec}"
                )
        new_shards = {}
        for sid, value in msg.tensors.items():
            name = split_shard_id(sid)[0]
            spec = next((s for s in specs if s["name"] == name), None)
            if spec is None or spec["kind"] != "dense":
                raise ValueError(f"init tensor {sid!r} is not a part of a dense parameter in this init")
            if sid not in self.shards:
                new_shards[sid] = Shard.dense(sid, value, spec["optimizer"])

        def apply() -> None:
            for spec in specs:
                self.params.setdefault(spec["name"], spec)
            for sid, shard in new_shards.items():
                self.shards.setdefault(sid, shard)

        return apply

    def spec_of(self, shard_or_table: str) -> dict:
        spec = self.params.get(shard_or_table) or self.params.get(split_shard_id(shard_or_table)[0])
        if spec is None:
            raise KeyError(f"unknown parameter for {shard_or_table!r} (not created by init on this server)")
        return spec

    def dense_shard(self, sid: str) -> Shard:
        shard = self.shards.get(sid)
        if shard is None or shard.kind != "dense":
            raise KeyError(f"this server holds no dense shard {sid!r}")
        return shard

    def _table_rows(
        self, table: str, ids: torch.Tensor, increasing: bool = False
    ) -> tuple[RowStore, Callable[[int], Shard]]:
        """The table's row store on this server, and ``shard_of(range index)`` (which creates an
        untouched range on first use, identically wherever it lands); ``ids`` are checked first."""
        spec = self.spec_of(table)
        if spec["kind"] != "sparse" or spec["name"] != table:
            raise ValueError(f"{table!r} is not a sparse table")
        rows, dim = spec["shape"]
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise TypeError(f"row ids for {table!r} must be a 1-D int64 tensor")
        if ids.numel():
            # ``increasing``: the caller checked the ids are sorted, so its ends bound them (no scans)
            low, high = (int(ids[0]), int(ids[-1])) if increasing else (int(ids.min()), int(ids.max()))
        if ids.numel() and (low < 0 or high >= rows):
            bad = ids[(ids < 0) | (ids >= rows)][0]
            raise ValueError(f"row id {int(bad)} out of range for table {table!r} with {rows} rows")
        rows_per_shard = spec["rows_per_shard"]
        store = self._row_stores.get(table)
        if store is None:
            store = self._row_stores[table] = RowStore(table, rows, rows_per_shard)

        def shard_of(index: int) -> Shard:
            sid = shard_id(table, index)
            shard = self.shards.get(sid)
            if shard is None:
                count = min(rows_per_shard, rows - index * rows_per_shard)
                shard = self.shards[sid] = Shard.sparse(sid, count, dim, spec["optimizer"], spec["init"])
            return shard

        return store, shard_of

    # -- push and pull -----------------------------------------------------------------------

    def prepare_push(self, msg: Message) -> list[Callable[[], None]]:
        """Check a push completely and return its updates; nothing changes until they run."""
        lr = msg.meta.get("lr")
        if lr is not None and (not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr >= 0):
            raise ValueError(f"push lr must be a number >= 0, got {lr!r}")
        round_ = msg.meta.get("round")  # the pusher's clock: a sync parameter's push joins that round
        if round_ is not None and (not isinstance(round_, int) or isinstance(round_, bool) or round_ < 0):
            raise ValueError(f"push round must be an int >= 0, got {round_!r}")
        compression = msg.meta.get("compression") or {}
        updates: list[Callable[[], None]] = []
        joins = False  # whether some of it joins a sync round
        for sid in msg.meta.get("shards", []):
            shard = self.dense_shard(sid)
            grad = self._decompress(msg, sid, compression[sid]) if sid in compression else msg.tensors[sid]
            if tuple(grad.shape) != shard.shape:
                raise ValueError(f"gradient for {sid!r} has shape {tuple(grad.shape)}, the shard {shard.shape}")
            grad = grad if grad.dtype == torch.float32 else grad.float()
            if round_ is not None and self.spec_of(sid)["mode"] == "sync":
                self.rounds.check_open(round_, msg.sender)  # (raises before anything changes)
                joins = True
                updates.append(lambda sid=sid, grad=grad: self.rounds.add_dense(round_, sid, grad, lr))
            else:
                updates.append(lambda shard=shard, grad=grad: shard.apply(grad, lr=lr))
        for table, names in (msg.meta.get("rows") or {}).items():
            ids, grads = msg.tensors[names[0]], msg.tensors[names[1]]
            dim = self.spec_of(table)["shape"][1]
            if grads.dim() != 2 or grads.shape != (ids.numel(), dim):
                raise ValueError(
                    f"row gradients for {table!r} have shape {tuple(grads.shape)}, expected {(ids.numel(), dim)}"
                )
            if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
                raise TypeError(f"row ids for {table!r} must be an int64 tensor")
            # Sum duplicate ids once for the whole push, then update every touched range in one
            # optimizer step over the table's packed rows (row_store.py).
            ids_np = ids.numpy()  # (the check in NumPy: three torch calls cost ~10 us a push)
            if ids_np.size < 2 or (ids_np[1:] > ids_np[:-1]).all():
                # Strictly increasing: already unique (how PSClient.push_rows sends them), so the
                # gradients are used as they came, without a sort and a sum.
                unique, summed = ids, grads if grads.dtype == torch.float32 else grads.float()
            else:
                unique, inverse = torch.unique(ids, return_inverse=True)
                summed = torch.zeros(unique.numel(), dim).index_add_(0, inverse, grads.float())
            store, shard_of = self._table_rows(table, unique, increasing=True)
            if unique.numel() and round_ is not None and self.spec_of(table)["mode"] == "sync":
                self.rounds.check_open(round_, msg.sender)
                joins = True
                updates.append(
                    lambda table=table, ids=unique, g=summed: self.rounds.add_rows(round_, table, ids, g, lr)
                )
            elif unique.numel():
                updates.append(
                    lambda store=store, shard_of=shard_of, ids=unique, g=summed: store.apply(
                        ids, g, shard_of, lr=lr, generation=self.shards_generation
                    )
                )
        if joins:
            updates.append(lambda: self.rounds.count_push(round_))
        return updates

    def apply_round(self, round_: int) -> None:
        """Apply the summed pushes of sync round ``round_``: one optimizer step per shard and table."""
        entry = self.rounds.take(round_)
        for sid, total in entry.dense.items():
            shard = self.shards.get(sid)
            if shard is None:  # moved away meanwhile (a rebalance is made while workers pause)
                log.error("sync round %d: shard %r is gone; its summed gradient is dropped", round_, sid)
                continue
            shard.apply(total, lr=entry.lr.get(sid))
        for table in entry.rows:
            ids, grads = entry.summed_rows(table)
            store, shard_of = self._table_rows(table, ids)
            store.apply(ids, grads, shard_of, lr=entry.lr.get(table), generation=self.shards_generation)

    def _decompress(self, msg: Message, sid: str, info: dict) -> torch.Tensor:
        from trainmesh.compression import Compressed, get_compressor

        name = info["spec"]
        if name not in self._decompressors:
            self._decompressors[name] = get_compressor(name)
        tensors = {key: msg.tensors[f"{sid}|{key}"] for key in info["keys"]}
        return self._decompressors[name].decompress(Compressed(tensors, info["meta"]))

    def pull_consistency(self, msg: Message) -> tuple[float, bool]:
        """(strictest staleness, any sync parameter) over what a pull reads; KeyError if unknown."""
        specs = [self.spec_of(sid) for sid in msg.meta.get("shards", [])]
        specs += [self.spec_of(table) for table in (msg.meta.get("rows") or {})]
        if not specs:
            return math.inf, False
        return min(_staleness(s) for s in specs), any(s["mode"] == "sync" for s in specs)

    def read(self, msg: Message) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """The values a pull asks for. Dense parts are the live tensors (no copy): the caller
        encodes them into the reply before any other request is served."""
        tensors, versions = {}, {}
        for sid in msg.meta.get("shards", []):
            shard = self.dense_shard(sid)
            tensors[sid], versions[sid] = shard.value, shard.version
        for table, ids_name in (msg.meta.get("rows") or {}).items():
            ids = msg.tensors[ids_name]
            store, shard_of = self._table_rows(table, ids)  # checks the ids
            if ids.numel():
                tensors[table], versions[table] = store.read(ids, shard_of, self.shards_generation)
            else:
                tensors[table], versions[table] = torch.empty(0, self.spec_of(table)["shape"][1]), 0
        return tensors, versions
