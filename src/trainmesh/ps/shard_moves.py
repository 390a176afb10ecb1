"""Moving shards between servers: the server's half of ``cluster.rebalance``.

``rebalance`` lists what each old server holds (EXPORT with ``list``), exports the shards whose
owner changes, imports them on their new owners, and only once every import is acknowledged
removes the old copies (EXPORT with ``remove``). A mixin of ``ServerState`` (server_state.py),
apart from the serving path (init, push, pull) because it runs only while workers pause. It uses
the state's ``shards``, ``params``, ``shards_generation`` and ``_row_stores``, all set up by
``ServerState.__init__``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .placement import split_shard_id
from .protocol import Message
from .shard import Shard


class ShardMoves:
    """``export`` and ``prepare_import`` of ``ServerState``: shards (and specs) out and in."""

    def export(self, meta: dict) -> tuple[dict[str, torch.Tensor], dict]:
        """Shard states for ``meta["shards"]`` (those this server holds) and every parameter spec.
        With ``meta["remove"]`` the shards are dropped afterwards (after their import succeeded)."""
        if meta.get("list"):
            return {}, {"shard_ids": sorted(self.shards), "params": self.params}
        tensors, shard_meta = {}, {}
        for sid in meta.get("shards", []):
            shard = self.shards.get(sid)
            if shard is None:
                continue  # a table range never touched: the new owner creates it identically
            if meta.get("data", True):
                own, shard_meta[sid] = shard.state_dict()
                tensors.update({f"{sid}|{k}": t for k, t in own.items()})  # live: encoded before any update
            if meta.get("remove"):
                del self.shards[sid]
                self.shards_generation += 1
                table, index = split_shard_id(sid)
                if table in self._row_stores:
                    self._row_stores[table].forget(index)
        return tensors, {"shards": shard_meta, "params": self.params}

    def prepare_import(self, msg: Message) -> Callable[[], None]:
        """Check moved-in shards (and specs); the returned call installs them."""
        params = msg.meta.get("params") or {}
        if not isinstance(params, dict) or not all(
            isinstance(s, dict) and s.get("name") == n for n, s in params.items()
        ):
            raise ValueError(f"import meta 'params' must map names to their specs, got {params!r:.200}")
        built = {}
        for sid, shard_meta in (msg.meta.get("shards") or {}).items():
            prefix = f"{sid}|"
            own = {k[len(prefix) :]: t for k, t in msg.tensors.items() if k.startswith(prefix)}
            built[sid] = Shard.from_state(own, shard_meta)

        def apply() -> None:
            for name, spec in params.items():
                self.params.setdefault(name, spec)
            self.shards.update(built)
            self.shards_generation += 1

        return apply
