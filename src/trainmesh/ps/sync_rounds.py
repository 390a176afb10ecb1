"""Synchronous rounds: a sync parameter's pushes are summed per round and applied once.

TensorFlow's ``SyncReplicasOptimizer`` in the server: a push of a ``sync`` parameter carries its
worker's clock (``meta["round"]``, the iteration it belongs to) and is added to that round's
sum, per dense shard and per table (rows kept as pushed, summed at apply time). Once every live
worker has clocked past the round (``min live clock > round``), the server applies the sum with
one optimizer step: momentum, Adam and AdamW state advance once per round, so N workers take
exactly the steps of one process on the global batch (the workers push ``1/N`` of their mean
gradient, see ``strategy.py``). Sync pulls already wait for that clock, so a pull at clock
``c`` sees rounds ``< c`` and nothing of round ``c``.

A round applied is written to the write-ahead log as a marker record after the pushes it sums,
so a replay rebuilds the same sums and applies them at the same points. A snapshot holds the
rounds still open (``state_chunks`` / ``load_chunks``). A push that arrives for a round already
applied is refused (``RoundClosed``): rounds close in order, and ``closed_below`` is the first
round still open. Only a worker that was declared dead (so left out of the min-clock) can send
one: its round went ahead without it, and adding its push later would be an extra optimizer step.
``closed_below`` is written in every round marker and in the snapshot's meta, so a replay refuses the same.

Why a round is complete when it closes: a worker's clock ``c`` counts on a server only once every
push that worker sent to that server before announcing ``c`` has been applied or refused (the
clock and pull messages carry ``after_pushes``, see server_pending.py), so ``min live clock > r`` means
every live worker's pushes of round ``r`` are in, whatever order the frames arrived in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SNAPSHOT_KEY = "#open-rounds/"  # snapshot entries of the open rounds, then a number (no shard id looks like it)


@dataclass
class Round:
    """The pushes of one round on one server, summed per dense shard; table rows as pushed."""

    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    lr: dict[str, float | None] = field(default_factory=dict)  # shard id or table -> the last push's lr
    pushes: int = 0

    def summed_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(unique ids, their summed gradients) of every push of ``table`` in this round."""
        parts = self.rows[table]
        ids = torch.cat([i for i, _ in parts])
        grads = torch.cat([g for _, g in parts])
        unique, inverse = torch.unique(ids, return_inverse=True)
        return unique, torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)


class RoundClosed(ValueError):
    """A sync push for a round this server already applied (its worker had been declared dead)."""

    code = "round_closed"


class OpenRounds:
    """The rounds of one server not applied yet, and where the closed ones end."""

    def __init__(self) -> None:
        self.rounds: dict[int, Round] = {}
        self.closed_below = 0  # every round < this one was applied (or closed empty): pushes refused

    def check_open(self, round_: int, worker: str) -> None:
        """Raise ``RoundClosed`` for a push of ``worker`` to a round that already closed."""
        if round_ < self.closed_below:
            raise RoundClosed(
                f"sync push of worker {worker} for round {round_} refused: rounds < "
                f"{self.closed_below} are closed (applied without this worker, which was "
                f"declared dead); its later rounds are accepted"
            )

    def close_below(self, slowest: float) -> list[int]:
        """Close every round below ``slowest`` (the smallest live clock); returns the open ones among
        them, oldest first, to apply now."""
        due = sorted(r for r in self.rounds if r < slowest)
        if slowest != float("inf"):
            self.closed_below = max(self.closed_below, int(slowest))
        return due

    def __bool__(self) -> bool:
        return bool(self.rounds)

    def add_dense(self, round_: int, sid: str, grad: torch.Tensor, lr: float | None) -> None:
        entry = self.rounds.setdefault(round_, Round())
        total = entry.dense.get(sid)
        # (a pushed gradient may be a view of the received frame: the sum needs its own memory)
        entry.dense[sid] = grad.to(torch.float32, copy=True) if total is None else total.add_(grad)
        entry.lr[sid] = lr if lr is not None else entry.lr.get(sid)

    def add_rows(self, round_: int, table: str, ids: torch.Tensor, grads: torch.Tensor, lr: float | None) -> None:
        entry = self.rounds.setdefault(round_, Round())
        entry.rows.setdefault(table, []).append((ids.clone(), grads.to(torch.float32, copy=True)))
        entry.lr[table] = lr if lr is not None else entry.lr.get(table)

    def count_push(self, round_: int) -> None:
        self.rounds.setdefault(round_, Round()).pushes += 1

    def take(self, round_: int) -> Round:
        return self.rounds.pop(round_, Round())

    @property
    def pending_pushes(self) -> int:
        return sum(r.pushes for r in self.rounds.values())

    # -- snapshots ----------------------------------------------------------------------------

    def state_chunks(self, per_chunk: int = 1000) -> list[tuple[dict[str, torch.Tensor], dict]]:
        """The open rounds as snapshot entries ``(tensors, meta)`` of at most ``per_chunk`` tensors
        each (a frame's header has a size limit); the first one's meta describes every round."""
        items: list[tuple[str, torch.Tensor]] = []
        meta: dict[str, dict] = {}
        for r, entry in self.rounds.items():
            items += [(f"{r}|d|{sid}", total) for sid, total in entry.dense.items()]
            for table, parts in entry.rows.items():
                for k, (ids, grads) in enumerate(parts):
                    items += [(f"{r}|r|{k}|ids|{table}", ids), (f"{r}|r|{k}|grads|{table}", grads)]
            meta[str(r)] = {
                "dense": sorted(entry.dense),
                "rows": {t: len(p) for t, p in entry.rows.items()},
                "lr": entry.lr,
                "pushes": entry.pushes,
            }
        chunks = [dict(items[i : i + per_chunk]) for i in range(0, len(items), per_chunk)] or [{}]
        return [(chunk, {"rounds": meta} if i == 0 else {}) for i, chunk in enumerate(chunks)]

    def load_chunks(self, chunks: list[tuple[dict[str, torch.Tensor], dict]]) -> None:
        """Restore what ``state_chunks`` gave."""
        tensors = {k: t for chunk, _ in chunks for k, t in chunk.items()}
        meta = next(m for _, m in chunks if "rounds" in m)
        self.rounds = {}
        for key, info in meta["rounds"].items():
            r = int(key)
            entry = self.rounds[r] = Round(lr=dict(info["lr"]), pushes=int(info["pushes"]))
            entry.dense = {sid: tensors[f"{r}|d|{sid}"].clone() for sid in info["dense"]}
            entry.rows = {
                table: [
                    (tensors[f"{r}|r|{k}|ids|{table}"].clone(), tensors[f"{r}|r|{k}|grads|{table}"].clone())
                    for k in range(count)
                ]
                for table, count in info["rows"].items()
            }
