"""The row ranges one server holds of one sparse table, packed into a few large tensors.

A table is split into row ranges of ``rows_per_shard`` rows (``Shard``s, placed by hashing), so a
push of 1024 random ids into a 1M-row table touches a hundred or more ranges on each server. Done
range by range, every range costs a few small tensor ops and their Python around them: the
server spent ~2 ms of a 2.7 ms push on that alone. Here the ranges a server holds live side by
side in slots of a few *pages* (one tensor per field per page: the value and each optimizer-state
field), and every ``Shard`` keeps working on views of its slot. A push is then one gather, one
optimizer update and one scatter per page it touches, whatever the number of ranges.

Pages have a fixed size (about ``PAGE_BYTES`` of values) and are added as ranges arrive, so what
is packed is never copied again and memory grows by one page at a time: no re-allocation that
would hold the table twice while it is copied.

``ServerState.shards`` stays the one source of truth: a range created, imported or restored there
is noticed here on the next push or pull that touches it (``_slot_for``), when the store compares
each touched range with the shard it packed for it. A shard met for the first time is copied into
a slot and re-pointed at it; one removed is released with ``forget``. A server passes its
``shards_generation`` (advanced by every replacement), so that check runs once per replacement,
not once per touched range per push. Versions live in one tensor per store (a view of it per
shard, see ``Shard.version``): a push advances them in one op.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .shard import Shard

# Values per page; optimizer state adds its own tensors of the same rows. Pages are allocated
# empty, so an unused part costs address space, not memory: at 256 MB a server's half of a
# 1M x 64 fp32 table is one page, and a push one optimizer step (at 64 MB it was two, each with
# its own mask, gather and step).
PAGE_BYTES = 256 << 20


class _Page:
    """``slots`` slots of ``rows_per_shard`` rows: the value and each optimizer-state field."""

    def __init__(self, slots: int, rows_per_shard: int, like: Shard):
        n = slots * rows_per_shard
        # empty, not zeros: a slot's pages are touched only when a range is packed into it
        self.value = torch.empty((n, *like.value.shape[1:]), dtype=like.value.dtype)
        self.state = {k: torch.empty((n, *t.shape[1:]), dtype=t.dtype) for k, t in like.state.items()}


class RowStore:
    """Slots of ``rows_per_shard`` rows holding one table's ranges on this server."""

    def __init__(self, table: str, rows: int, rows_per_shard: int):
        self.table, self.rows_per_shard = table, rows_per_shard
        self.pages: list[_Page] = []
        self.slots_per_page = 0  # set by the first range packed (from its row size)
        ranges = -(-rows // rows_per_shard)
        self.slot_of_range = torch.full((ranges,), -1, dtype=torch.int64)  # -1: not packed here
        self._slot_of_range_np = self.slot_of_range.numpy()  # the same memory (never reassigned)
        self.packed: dict[int, Shard] = {}  # range -> the shard whose tensors are views of its slot
        self._free: list[int] = []
        self._slots_used = 0
        self.versions = torch.zeros(0, dtype=torch.int64)  # per slot: its range's version
        self._generation: int | None = None  # the caller's shards generation last checked

    # -- reads and updates ---------------------------------------------------------------

    def apply(
        self,
        ids: torch.Tensor,
        grads: torch.Tensor,
        shard_of: Callable[[int], Shard],
        lr: float | None = None,
        generation: int | None = None,
    ) -> None:
        """Update rows ``ids`` (unique, in range) with ``grads`` (one row each): one optimizer step
        per page touched; each touched range's version advances once (one tensor op).
        ``generation``: see ``_rows``."""
        rows, slots, first = self._rows(ids, shard_of, generation)
        step_rows = first.optimizer.step_rows
        for page, where, local in self._by_page(rows):
            step_rows(page.value, local, grads if where is None else grads[where], page.state, lr=lr, unique_rows=True)
        self.versions.index_add_(0, slots, torch.ones_like(slots))

    def read(
        self, ids: torch.Tensor, shard_of: Callable[[int], Shard], generation: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """``(a copy of rows ids, the newest version among their ranges)``; ids in range."""
        rows, slots, _ = self._rows(ids, shard_of, generation)
        parts = self._by_page(rows)
        if len(parts) == 1:
            page, _, local = parts[0]
            out = page.value[local]
        else:
            out = torch.empty((ids.numel(), *self.pages[0].value.shape[1:]), dtype=self.pages[0].value.dtype)
            for page, where, local in parts:
                out[where] = page.value[local]
        return out, int(self.versions[slots].max())

    # -- slots ---------------------------------------------------------------------------

    def _rows(
        self, ids: torch.Tensor, shard_of: Callable[[int], Shard], generation: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, Shard]:
        """``(where rows ids (non-empty) live: slot * rows_per_shard + row, the touched slots
        (unique), one touched shard)``.

        Each touched range is checked against ``shard_of`` (its shard may have been replaced),
        a Python call per range: a push of 1024 random ids touches a hundred or more. A caller
        that counts its replacements passes ``generation`` (``ServerState.shards_generation``):
        while it is the one the store last checked against, only ranges not packed yet are
        looked up, and the packed ones are taken from ``slot_of_range`` in one array op."""
        # The index arithmetic runs in NumPy on views of the ids and of ``slot_of_range`` (shared
        # memory): on the ~500 ids of a push each NumPy op costs a microsecond or two where a torch
        # op costs 5-15, and a push made a dozen (about 25 us of the server's ~250 us per push).
        ids_np = ids.numpy()
        ranges = ids_np // self.rows_per_shard
        slot_of_row = self._slot_of_range_np[ranges]
        if generation is None or generation != self._generation:
            check = np.unique(ranges).tolist()  # every touched range
        elif slot_of_row.min() < 0:
            check = np.unique(ranges[slot_of_row < 0]).tolist()  # only the new ones
        else:
            check = []
        for index in check:
            self._slot_for(index, shard_of(index))
        if generation is not None and generation != self._generation:
            # Every range packed here may have been replaced since: check them all once.
            for index in list(self.packed):
                self._slot_for(index, shard_of(index))
            self._generation = generation
        if check:
            slot_of_row = self._slot_of_range_np[ranges]
        rows = (slot_of_row - ranges) * self.rows_per_shard + ids_np  # slot's first row + offset in range
        if ids_np.size < 2 or (ranges[1:] >= ranges[:-1]).all():
            # Increasing ids (how a push and a pull send them): each range's rows are adjacent, so
            # the touched slots are the first row of each run, without np.unique's sort.
            # (one comparison written into one mask: np.diff with prepend built two more arrays,
            # 8.7 against 2.7 us on 512 ids)
            first_of_run = np.empty(ranges.size, dtype=bool)
            first_of_run[0] = True
            np.not_equal(ranges[1:], ranges[:-1], out=first_of_run[1:])
            slots = slot_of_row[np.flatnonzero(first_of_run)]
        else:
            slots = np.unique(slot_of_row)
        first = self.packed[int(ranges[0])]
        return torch.from_numpy(rows), torch.from_numpy(slots), first

    def _by_page(self, rows: torch.Tensor) -> list[tuple[_Page, torch.Tensor | None, torch.Tensor]]:
        """``[(page, positions in rows or None for all, rows within the page)]``."""
        page_rows = self.slots_per_page * self.rows_per_shard
        if len(self.pages) == 1:
            return [(self.pages[0], None, rows)]
        page_of_row = rows // page_rows
        out = []
        for index in torch.unique(page_of_row).tolist():
            where = (page_of_row == index).nonzero().reshape(-1)
            out.append((self.pages[index], where, rows[where] - index * page_rows))
        return out

    def _slot_for(self, index: int, shard: Shard) -> Shard:
        """Make sure range ``index`` is packed from ``shard`` (the server's current one)."""
        if self.packed.get(index) is shard:
            return shard
        if index in self.packed:  # replaced since (an import or a restore): its slot takes the new data
            slot = int(self.slot_of_range[index])
            self.packed[index].keep_version_in(None)  # the old shard's count is its own again
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
            shard.keep_version_in(None)
            # The shard owns its data again (an export may still be encoding it; the slot is reused).
            shard.value, shard.state = shard.value.clone(), {k: t.clone() for k, t in shard.state.items()}
            self._free.append(int(self.slot_of_range[index]))
            self.slot_of_range[index] = -1

    def _new_slot(self, shard: Shard) -> int:
        if not self.pages:  # pages of about PAGE_BYTES, never more slots than the table has ranges
            slot_bytes = self.rows_per_shard * shard.value[0].numel() * shard.value.element_size()
            self.slots_per_page = max(1, min(self.slot_of_range.numel(), PAGE_BYTES // slot_bytes))
        if self._slots_used == len(self.pages) * self.slots_per_page:
            self.pages.append(_Page(self.slots_per_page, self.rows_per_shard, shard))
            self.versions = torch.cat([self.versions, torch.zeros(self.slots_per_page, dtype=torch.int64)])
            for slot, packed in enumerate(self._by_slot()):  # the cells were views of the old tensor
                if packed is not None:
                    packed.keep_version_in(self.versions[slot : slot + 1])
        self._slots_used += 1
        return self._slots_used - 1

    def _pack(self, slot: int, shard: Shard) -> None:
        page = self.pages[slot // self.slots_per_page]
        if shard.state.keys() != page.state.keys() or shard.value.shape[1:] != page.value.shape[1:]:
            raise ValueError(
                f"range {shard.shard_id!r} does not fit table {self.table!r}'s other ranges "
                f"(state {sorted(shard.state)} vs {sorted(page.state)})"
            )
        start = (slot % self.slots_per_page) * self.rows_per_shard
        stop = start + shard.value.shape[0]  # the table's last range may be shorter
        value, state = page.value[start:stop], {k: t[start:stop] for k, t in page.state.items()}
        value.copy_(shard.value)
        for key, tensor in state.items():
            tensor.copy_(shard.state[key])
        shard.value, shard.state = value, state
        shard.keep_version_in(self.versions[slot : slot + 1])

    def _by_slot(self) -> list[Shard | None]:
        """The shard packed in each slot (None: free)."""
        out: list[Shard | None] = [None] * self.versions.numel()
        for index, shard in self.packed.items():
            out[int(self.slot_of_range[index])] = shard
        return out
