"""Batches from workers through reused shared-memory slots, instead of a fresh shared block each.

Torch's workers collate every batch into a newly allocated shared-memory block and send its file
descriptor; the main process maps it, and both sides fault its pages in anew and unmap it later.
Measured at the dataloader benchmark's setting (64 samples of 3x64x64 float32, 3 MiB a batch),
that collation cost 4.5 ms of CPU in a probe where stacking into memory already touched cost
0.3 ms; in the workers, CPU per batch fell from 10.0-11.8 ms to 8.8-9.5 ms (load 19-35, 2 cores).

Here each worker keeps a few slots (a shared uint8 arena each, grown to the largest batch seen) and
stacks the batch's tensors into one whose flag is free. What travels is the layout (offsets,
shapes, dtypes), plus the arena itself the first time the main process sees it. Un-pickling in the
main process copies the tensors out (straight into pinned memory when the loader pins) and frees
the slot. The copy is what makes reuse safe: the training step may hold a batch for as long as it
likes. Unpinned, it copies into memory of earlier batches that nothing refers to any more
(``OutputPool``), not into fresh pages. Whatever does not fit, a custom collate function, or no free slot (a result dropped unread
at shutdown) takes torch's own path, so this never waits and never blocks a worker.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate, default_collate_fn_map

_ALIGN = 64
_LIVE: dict[str, "BatchSlots"] = {}  # main process: the slots of each open loader, by token
_WORKER: dict[str, "_WorkerSlots"] = {}  # worker process: its slots, by loader token


@dataclass(frozen=True)
class _Leaf:
    """Where one collated tensor lies in its slot's arena."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _WorkerArenas:
    generation: int = 0
    arena: torch.Tensor | None = None  # uint8, in shared memory
    sent: int = -1  # the generation the main process has been sent
    wanted: int = 0  # bytes the last batch needed: the next arena's size when it did not fit


class _WorkerSlots:
    """One worker process's slots. Its flags are its own (not a row per worker id, made before the
    workers start): a worker that outlives its iterator beside its successor of the same id (a
    non-persistent worker whose shutdown is late) must not free or fill the other's slots."""

    def __init__(self, count: int):
        self.pid = os.getpid()
        self.flags = torch.zeros(count, dtype=torch.uint8).share_memory_()  # 1: in use
        self.arenas = [_WorkerArenas() for _ in range(count)]


def _map(fn: Callable[[Any], Any], obj: Any, leaf: type) -> Any:
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map(fn, o, leaf) for o in obj))
    if type(obj) in (tuple, list):
        return type(obj)(_map(fn, o, leaf) for o in obj)
    if type(obj) is dict:
        return {k: _map(fn, v, leaf) for k, v in obj.items()}
    return obj


class _Bump:
    """Hands out consecutive aligned pieces of an arena to the collated tensors of one batch."""

    def __init__(self, arena: torch.Tensor | None):
        self.arena, self.offset = arena, 0
        self.placed: dict[int, _Leaf] = {}  # id(tensor) -> where it lies

    def _piece(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The next piece of the arena for a tensor of ``shape``; None where the arena is too small
        (its size is still counted, so the next arena holds the whole batch)."""
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        start = -(-self.offset // _ALIGN) * _ALIGN
        self.offset = start + nbytes
        if self.arena is None or start + nbytes > self.arena.numel():
            return None
        out = self.arena[start : start + nbytes].view(dtype).view(shape)
        self.placed[id(out)] = _Leaf(start, shape, dtype)
        return out

    def stack(self, batch, *, collate_fn_map=None):
        elem = batch[0]
        if elem.layout != torch.strided or elem.device.type != "cpu" or any(t.shape != elem.shape for t in batch):
            return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # torch's path (and its errors)
        out = self._piece((len(batch), *elem.shape), elem.dtype)
        if out is None:
            return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        torch.stack(batch, 0, out=out)
        return out

    # Python numbers (labels, indices) as torch's collate_int_fn / collate_float_fn make them. Why in
    # the slot: a tensor left out of it travels as its own shared-memory block and file descriptor,
    # which cost the main process 0.42 ms a batch for 64 int labels (1.64 against 1.22 ms of the
    # prefetch thread's CPU per batch, the dataloader benchmark's decode setting, load 19).
    def ints(self, batch, *, collate_fn_map=None):
        return self._copy_in(torch.tensor(batch))

    def floats(self, batch, *, collate_fn_map=None):
        return self._copy_in(torch.tensor(batch, dtype=torch.float64))

    def _copy_in(self, made: torch.Tensor) -> torch.Tensor:
        out = self._piece(tuple(made.shape), made.dtype)
        return made if out is None else out.copy_(made)


class SlotBatch:
    """A batch collated into a worker's slot; un-pickled in the main process, it is the plain batch."""

    def __init__(self, token: str, worker: int, slot: int, slots: _WorkerSlots, layout: Any):
        self.token, self.worker, self.slot, self.slots, self.layout = token, worker, slot, slots, layout

    def __reduce__(self):
        state = self.slots.arenas[self.slot]
        sent = state.sent != state.generation  # the arena (and the flags) once per arena, by fd
        state.sent = state.generation
        arena, flags = (state.arena, self.slots.flags) if sent else (None, None)
        args = (self.token, self.worker, self.slot, self.slots.pid, state.generation, arena, flags, self.layout)
        return _rebuild, args


# c10's count of references to a storage (tensors, views, storage objects); None where torch lacks it
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


class OutputPool:
    """Main process: the memory that batches are copied out into, reused once nothing refers to it.

    Why: a fresh tensor of a few MiB is fresh pages (glibc gives large blocks back to the kernel on
    free), and faulting them in was most of the copy-out: in a probe, 0.67 ms to allocate and copy a
    3 MiB batch against 0.07 ms to copy it into memory already touched. A storage is handed out again
    only when this pool holds its one reference: a batch, a view of it, a numpy array over it or
    autograd's record of it keeps its memory out of reuse, so a step can hold a batch as long as it
    likes. Not for pinned memory: an asynchronous copy to the GPU may still read a pinned batch its
    holder has dropped; torch's caching host allocator tracks that, this pool could not.
    """

    def __init__(self, per_size: int):
        self.per_size = per_size  # storages kept per byte size; beyond, a batch gets its own memory
        self.storages: dict[int, list[torch.UntypedStorage]] = {}

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if _STORAGE_USE_COUNT is None:
            return torch.empty(shape, dtype=dtype)
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        kept = self.storages.setdefault(nbytes, [])
        # One reference (this list's) means unused: nothing can take a new one but this pool.
        storage = next((s for s in kept if _STORAGE_USE_COUNT(s._cdata) == 1), None)
        if storage is None:
            storage = torch.UntypedStorage(nbytes)
            if len(kept) < self.per_size:
                kept.append(storage)
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def clear(self) -> None:
        self.storages.clear()


def _rebuild(token, worker, slot, pid, generation, arena, flags, layout):
    slots = _LIVE.get(token)
    if slots is None:
        raise RuntimeError("a worker's batch arrived for a DataLoader that is closed")
    if arena is not None:
        for key in [k for k, v in slots.arenas.items() if v[0] == worker and k[0] != pid]:
            del slots.arenas[key]  # a previous process of this worker id: its slots are gone with it
        slots.arenas[pid, slot] = (worker, generation, arena, flags)
    have = slots.arenas.get((pid, slot))
    if have is None or have[1] != generation:
        raise RuntimeError(f"worker {worker} (pid {pid}): the arena of its slot {slot} was never received")
    _, _, arena, flags = have

    def copy_out(leaf: _Leaf) -> torch.Tensor:
        nbytes = leaf.dtype.itemsize * int(torch.Size(leaf.shape).numel())
        view = arena[leaf.offset : leaf.offset + nbytes].view(leaf.dtype).view(leaf.shape)
        if slots.outputs is None:
            return torch.empty(leaf.shape, dtype=leaf.dtype, pin_memory=slots.pin).copy_(view)
        return slots.outputs.empty(leaf.shape, leaf.dtype).copy_(view)

    batch = _map(copy_out, layout, _Leaf)
    flags[slot] = 0  # copied: the worker may fill it again
    return batch


class BatchSlots:
    """Made in the main process before the workers start; ``collate`` runs in the workers.

    ``slots`` per worker: torch keeps up to ``prefetch_factor`` results of a worker in flight,
    and a slot is freed as soon as the main process un-pickles its batch, so that many plus
    one never runs short in steady state.
    """

    def __init__(self, num_workers: int, slots: int, pin: bool):
        self.token = uuid.uuid4().hex
        self.count, self.pin = slots, pin
        # main process only: (pid, slot) -> (worker id, generation, arena, that process's flags)
        self.arenas: dict[tuple[int, int], tuple[int, int, torch.Tensor, torch.Tensor]] = {}
        # It grows only to the most batches alive at once (read ahead, in the step, kept by the caller)
        self.outputs = None if pin else OutputPool(per_size=16)
        _LIVE[self.token] = self

    def __getstate__(self) -> dict[str, Any]:  # to spawned workers: not the main process's arenas
        return {"token": self.token, "count": self.count, "pin": self.pin, "arenas": {}, "outputs": None}

    def busy(self) -> int:
        """Slots whose batch the main process has not received yet (0 once a pass is drained)."""
        return sum(int(v[3].sum()) for v in {id(v[3]): v for v in self.arenas.values()}.values())

    def close(self) -> None:
        _LIVE.pop(self.token, None)
        self.arenas.clear()
        if self.outputs is not None:
            self.outputs.clear()

    def collate(self, samples: list) -> Any:
        info = get_worker_info()
        if info is None:
            return default_collate(samples)  # main process: private memory, nothing to send
        worker = info.id
        slots = _WORKER.get(self.token)
        if slots is None or slots.pid != os.getpid():  # a new worker process (or one forked with a parent's)
            slots = _WORKER[self.token] = _WorkerSlots(self.count)
        free = (slots.flags == 0).nonzero()
        if not len(free):
            return default_collate(samples)
        slot = int(free[0])
        state = slots.arenas[slot]
        if state.wanted > (0 if state.arena is None else state.arena.numel()):
            size = -(-state.wanted * 5 // 4 // 4096) * 4096  # headroom for batches a little larger
            state.arena = torch.empty(size, dtype=torch.uint8).share_memory_()
            state.generation += 1
        slots.flags[slot] = 1
        bump = _Bump(state.arena)
        kinds = {torch.Tensor: bump.stack, int: bump.ints, float: bump.floats}
        batch = collate(samples, collate_fn_map={**default_collate_fn_map, **kinds})
        state.wanted = max(state.wanted, bump.offset)
        if not bump.placed:
            slots.flags[slot] = 0
            return batch
        placed = dict(bump.placed)
        layout = _map(lambda t: placed.pop(id(t), t), batch, torch.Tensor)
        if placed:  # a tensor inside a container we do not rebuild: torch's own path, slot unused
            slots.flags[slot] = 0
            return default_collate(samples)
        return SlotBatch(self.token, worker, slot, slots, layout)
