"""``save_pretrained``'s plan: which tensors, under which names, in which file, written by which process,
and which process sends which run of each tensor to its writer. Made from every process's list of what
it holds (``hf_save._describe``); the first process makes it and broadcasts it (``hf_save._plan_and_stage``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from . import hf_layout
from .hf_expert_names import expert_runs, none_converted
from .hf_layout import Entry, FilePlan


@dataclass
class Item:
    """One output tensor and where it comes from."""

    entry: Entry
    source: str  # the local name it is read under
    holders: list[int]  # processes holding ``source``
    source_dtype: torch.dtype
    ranges: dict[int, tuple[int, int] | None]  # holder -> its contiguous run (start, numel), None if not one
    writer: int = 0
    pieces: list[tuple[int, int, int]] | None = None  # (sender, start, numel) tiling the tensor; None: gather
    offset: int = 0  # where it starts in ``source``, flat: a per-expert tensor of fused experts (hf_expert_names)


def make_plan(
    described: list[dict[str, Any]],
    max_bytes: int,
    dtype: torch.dtype | None,
    patterns: list[str],
    module: nn.Module | None = None,
) -> tuple[list[Item], list[FilePlan]]:
    info: dict[str, dict[str, Any]] = {}  # name -> shape, dtype, order, holders' runs
    for rank, part in enumerate(described):
        for position, (name, shape, dtype_name, run, stage, is_param) in enumerate(part["tensors"]):
            seen = info.setdefault(
                name,
                {
                    "shape": shape,
                    "dtype": getattr(torch, dtype_name),
                    "ranges": {},
                    "order": (stage, position, rank),
                    "is_param": is_param,
                },
            )
            if seen["shape"] != shape:
                raise RuntimeError(f"Processes disagree on the shape of {name!r}: {seen['shape']} vs {shape}.")
            seen["ranges"][rank] = run
    names = sorted(info, key=lambda n: info[n]["order"])
    order = {name: i for i, name in enumerate(names)}
    written = {name: name for name in names}  # written name -> source name
    for group in hf_layout.merge_groups(g for part in described for g in part["ties"]):
        keep = hf_layout.kept_name(group, patterns, order)
        for name in group:
            written.pop(name, None)
        written[keep] = min((n for n in group if n in info), key=lambda n: (n != keep, order[n]))
    items = []
    if none_converted(module, {name: tuple(info[source]["shape"]) for name, source in written.items()}):
        module = None  # no fused experts: no per-tensor probes
    for name, source in written.items():
        meta = info[source]
        out_dtype = dtype if dtype is not None and meta["dtype"].is_floating_point else meta["dtype"]
        entry = Entry(name, tuple(meta["shape"]), out_dtype, meta["is_param"], order[source])
        runs = expert_runs(module, name, entry.shape) if module is not None else None
        for run_name, shape, offset in runs or [(name, entry.shape, 0)]:  # fused experts: transformers' names
            part = Entry(run_name, shape, out_dtype, meta["is_param"], order[source])
            items.append(Item(part, source, sorted(meta["ranges"]), meta["dtype"], meta["ranges"], offset=offset))
    files = hf_layout.plan_files([i.entry for i in items], max_bytes)
    _assign_writers(items, files, len(described))
    by_name = {i.entry.name: i for i in items}
    ordered = [by_name[e.name] for f in files for e in f.entries]  # the order tensors travel in
    for item in ordered:
        item.pieces = _pieces(item)
    return ordered, files


def by_file(items: list[Item], files: list[FilePlan]) -> Iterator[tuple[FilePlan, list[Item]]]:
    """Each file with its items: ``items`` lists every file's entries in file order (``make_plan``'s
    order), so a file's items are the next ``len(plan.entries)`` of them."""
    start = 0
    for plan in files:
        yield plan, items[start : start + len(plan.entries)]
        start += len(plan.entries)


def _assign_writers(items: list[Item], files: list[FilePlan], world_size: int) -> None:
    """Files in turn to the least busy processes; among those, the one holding most of the file."""
    by_name = {i.entry.name: i for i in items}
    counts = [0] * world_size
    for plan in files:
        held = [0] * world_size
        for entry in plan.entries:
            for rank in by_name[entry.name].holders:
                held[rank] += entry.nbytes
        writer = min(range(world_size), key=lambda r: (counts[r], -held[r], r))
        counts[writer] += 1
        plan.writer = writer
        for entry in plan.entries:
            by_name[entry.name].writer = writer


def _pieces(item: Item) -> list[tuple[int, int, int]] | None:
    """Who sends which run of the tensor to its writer (the writer itself where it holds the run),
    in order; None when the holders' parts do not tile it in runs (then it is gathered whole)."""
    if any(run is None for run in item.ranges.values()):
        return None
    senders: dict[tuple[int, int], int] = {}
    low, high = item.offset, item.offset + item.entry.numel
    for rank, (start, count) in sorted(item.ranges.items(), key=lambda kv: (kv[0] != item.writer, kv[0])):
        start, stop = max(start, low), min(start + count, high)  # the part of the run inside this item
        # replicas of one run: the writer's own copy, else the lowest process
        senders.setdefault((start - low, max(stop - start, 0)), rank)
    pieces, end = [], 0
    for (start, count), rank in sorted(senders.items()):
        if count == 0:
            continue
        if start != end:
            return None
        pieces.append((rank, start, count))
        end = start + count
    return pieces if end == item.entry.numel else None
