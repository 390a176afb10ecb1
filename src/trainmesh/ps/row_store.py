"""The row ranges one server holds of one sparse table, packed into one tensor per field.

A table is split into row ranges of ``rows_per_shard`` rows (``Shard``s, placed by hashing), so a
push of 1024 random ids into a 1M-row table touches a hundred or more ranges on each server. Done
range by range, every range costs a few small tensor ops and their Python around them: the
server spent ~2 ms of a 2.7 ms push on that alone. Here the ranges a server holds live side by
side in slots of one ``value`` tensor (and one tensor per optimizer-state field), and every
``Shard`` keeps working on views of its slot. A push is then one gather, one optimizer update and
one scatter over the whole table, whatever the number of ranges it touches.

``ServerState.shards`` stays the one source of truth: a range created, imported, restored or
removed there is noticed here on the next push or pull that touches it (``_slots``), when the
store compares each touched range with the shard it packed for it. A shard met for the first
time is copied into a slot and re-pointed at it.
"""

from __future__ import annotations

from typing import Callable

import torch

from .shard import Shard

_FIRST_SLOTS = 8  # slots allocated at first; then the store doubles (amortised copies)


class RowStore:
    """Slots of ``rows_per_shard`` rows holding one table's ranges on this server."""

    def __init__(self, table: str, rows: int, rows_per_shard: int):
        self.table, self.rows, self.rows_per_shard = table, rows, rows_per_shard
        self.value: torch.Tensor | None = None  # (slots * rows_per_shard, dim)
        self.state: dict[str, torch.Tensor] = {}  # optimizer-state field -> (slots * rows_per_shard, ...)
        ranges = -(-rows // rows_per_shard)
        self.slot_of_range = torch.full((ranges,), -1, dtype=torch.int64)  # -1: not packed here
        self.packed: dict[int, Shard] = {}  # range -> the shard whose tensors are views of its slot
        self._free: list[int] = []
        self._slots_used = 0

    # -- reads and updates ---------------------------------------------------------------

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, shard_of: Callable[[int], Shard],
              lr: float | None = None) -> None:
        """Update rows ``ids`` (sorted, unique, in range) with ``grads`` (one row each), as one
        optimizer step over every touched range; each touched range's version advances once."""
        rows, touched = self._rows(ids, shard_of)
        touched[0].optimizer.step_rows(self.value, rows, grads, self.state, lr=lr)
        for shard in touched:
            shard.version += 1

    def read(self, ids: torch.Tensor, shard_of: Callable[[int], Shard]) -> tuple[torch.Tensor, int]:
        """``(a copy of rows ids, the newest version among their ranges)``; ids in range."""
        rows, touched = self._rows(ids, shard_of)
        return self.value[rows], max(shard.version for shard in touched)

    # -- slots ---------------------------------------------------------------------------

    def _rows(self, ids: torch.Tensor, shard_of: Callable[[int], Shard]) -> tuple[torch.Tensor, list[Shard]]:
        """Where rows ``ids`` (non-empty) live in the packed tensors, and the touched shards."""
        ranges = ids // self.rows_per_shard
        touched_ranges = torch.unique(ranges).tolist()
        touched = [self._slot_for(r, shard_of(r)) for r in touched_ranges]
        rows = self.slot_of_range[ranges] * self.rows_per_shard + (ids - ranges * self.rows_per_shard)
        return rows, touched

    def _slot_for(self, index: int, shard: Shard) -> Shard:
        """Make sure range ``index`` is packed from ``shard`` (the server's current one)."""
        if self.packed.get(index) is shard:
            return shard
        if index in self.packed:  # replaced since (an import or a restore): its slot takes the new data
            slot = int(self.slot_of_range[index])
        else:
            slot = self._free.pop() if self._free else self._new_slot(shard)
        self._pack(slot, shard)
        self.slot_of_range[index] = slot
        self.packed[index] = shard
        return shard

    def forget(self, index: int) -> None:
        """Range ``index`` left this server: its slot is free again (the shard keeps its data)."""
        shard = self.packed.pop(index, None)
        if shard is not None:
            # The shard owns its data again (an export may still be encoding it; the slot is reused).
            shard.value, shard.state = shard.value.clone(), {k: t.clone() for k, t in shard.state.items()}
            self._free.append(int(self.slot_of_range[index]))
            self.slot_of_range[index] = -1

    def _new_slot(self, shard: Shard) -> int:
        if self.value is None:
            self._allocate(_FIRST_SLOTS, shard)
        elif self._slots_used * self.rows_per_shard == self.value.shape[0]:
            self._allocate(2 * self._slots_used, shard)
        self._slots_used += 1
        return self._slots_used - 1

    def _allocate(self, slots: int, shard: Shard) -> None:
        """(Re)allocate room for ``slots`` slots, keep what is packed, re-point its shards."""
        n = slots * self.rows_per_shard
        old_value, old_state = self.value, self.state
        # empty, not zeros: pages of slots never used are never touched
        self.value = torch.empty((n, *shard.value.shape[1:]), dtype=shard.value.dtype)
        self.state = {k: torch.empty((n, *t.shape[1:]), dtype=t.dtype) for k, t in shard.state.items()}
        if old_value is not None:
            used = old_value.shape[0]
            self.value[:used] = old_value
            for key, tensor in self.state.items():
                tensor[:used] = old_state[key]
            for index, packed in self.packed.items():
                packed.value, packed.state = self._slot_views(int(self.slot_of_range[index]), packed)

    def _pack(self, slot: int, shard: Shard) -> None:
        if shard.state.keys() != self.state.keys() or shard.value.shape[1:] != self.value.shape[1:]:
            raise ValueError(f"range {shard.shard_id!r} does not fit table {self.table!r}'s other ranges "
                             f"(state {sorted(shard.state)} vs {sorted(self.state)})")
        value, state = self._slot_views(slot, shard)
        value.copy_(shard.value)
        for key, tensor in state.items():
            tensor.copy_(shard.state[key])
        shard.value, shard.state = value, state

    def _slot_views(self, slot: int, shard: Shard) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Views of ``slot`` sized for ``shard`` (the table's last range may be shorter)."""
        start = slot * self.rows_per_shard
        stop = start + shard.value.shape[0]
        return self.value[start:stop], {k: t[start:stop] for k, t in self.state.items()}
