"""``save_pretrained``: any trainmesh model, any layout, to the Hugging Face checkpoint layout.

Collective: every process calls it. The plan (which tensors, under which names, in which file,
written by which process) is made from every process's list of what it holds, so it is the same
everywhere, and then the tensors go one at a time, file after file:

* a shard that is one contiguous run of the full tensor (ZeRO-3's, a column-wise tensor-parallel
  weight's) goes to the writer of its file as it is, and is written at its place: the writer
  holds one shard at a time and nobody holds the whole tensor;
* a replicated tensor (DDP, ZeRO-1) is one such piece held everywhere: the writer reads its own;
* any other shard (a row-wise tensor-parallel weight) is gathered by the processes holding it
  (``full_tensor``); the writer keeps the result, the others drop it at once;
* under a pipeline each stage holds its own layers, and pieces travel to a writer of another
  stage the same way (point to point, over a gloo group).

Files go to writers in turn (the one holding most of a file's bytes among the least busy). Files
with distinct writers whose tensors all travel in runs form a round: their pieces move at once
and the writers write in parallel, each holding at most its one file in flight; a file with a
tensor gathered whole is streamed tensor by tensor (``hf_layout``). Each writer fsyncs its files
in a thread beside the next rounds. A writer that fails still receives every piece sent to
it, so no process hangs; every process then raises, and nothing is published
(``hf_layout.commit``).
"""

from __future__ import annotations

import datetime
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import runtime
from . import hf_layout
from .hf_expert_names import expert_runs
from .hf_layout import Entry, FilePlan


@dataclass
class _Item:
    """One output tensor and where it comes from."""

    entry: Entry
    source: str  # the local name it is read under
    holders: list[int]  # processes holding ``source``
    source_dtype: torch.dtype
    ranges: dict[int, tuple[int, int] | None]  # holder -> its contiguous run (start, numel), None if not one
    writer: int = 0
    pieces: list[tuple[int, int, int]] | None = None  # (sender, start, numel) tiling the tensor; None: gather
    offset: int = 0  # where it starts in ``source``, flat: a per-expert tensor of fused experts (hf_expert_names)


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    merge_adapters: bool = False,
) -> str:
    """Write ``model``'s full weights to ``directory`` in the Hugging Face layout. Collective.

    Works for a model from any trainmesh layout: plain, DDP, ZeRO 1-3, ModelParallel (tensor
    parallel), a pipeline and the 3-D layout. Writes ``model.safetensors`` (or
    ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` beyond
    ``max_shard_size``), and ``config.json`` / ``generation_config.json`` when the model (or the
    transformers model inside a wrapper) has them. Tied weights are written once, under the name
    transformers expects. ``dtype`` casts floating tensors on the way out (e.g. ``torch.bfloat16``).
    Names are the ones transformers' own ``save_pretrained`` writes: the model's state-dict names, and
    for fused MoE experts (which transformers converts on load) its per-expert names, each expert's
    tensor written from the processes holding it (``hf_expert_names``). ``directory`` must be on a file system every process sees; a previous checkpoint
    there is replaced only once the new one is complete. Returns ``directory``.

    A peft LoRA model is saved as peft saves it: ``adapter_model.safetensors`` and
    ``adapter_config.json`` of its active adapter (``PeftModel.from_pretrained(base, directory)``
    loads them); with ``merge_adapters=True``, as the full base model with the adapters merged into
    its weights, under the base model's names (``peft_save.py``).

    >>> tm.save_pretrained(trainer.model, "out/my-llama", max_shard_size="2GB")   # doctest: +SKIP
    >>> transformers.AutoModelForCausalLM.from_pretrained("out/my-llama")           # doctest: +SKIP
    """
    directory = os.fspath(directory)
    max_bytes = hf_layout.parse_size(max_shard_size)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None. Received: dtype={dtype!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_pretrained saves an nn.Module. Received: {type(model).__name__}")
    from .peft_save import view_for

    view = view_for(model, merge_adapters)  # None: the model's own tensors, as they are
    group = _new_group()
    try:
        return _save(model, directory, max_bytes, dtype, group, view)
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def _save(model, directory, max_bytes, dtype, group, view=None) -> str:
    rank = dist.get_rank() if group is not None else 0
    local = _local_state(model) if view is None else view.local_state(model, _local_state(model))
    described = _all_gather(_describe(model, local), group)
    items, files = _plan(
        described,
        max_bytes if view is None else view.max_bytes(max_bytes),
        dtype,
        hf_layout.tied_target_patterns(_unwrap(model)),
        _unwrap(model) if view is None else None,
    )
    if view is not None:
        view.rename(items, files)
    staging, problem = None, None
    if rank == 0:
        try:
            staging = hf_layout.prepare_staging(directory)
        except Exception as exc:  # told to everyone, before any tensor moves
            problem = f"{type(exc).__name__}: {exc}"
    staging, problem = _broadcast((staging, problem), group)
    if problem is not None:
        raise RuntimeError(f"save_pretrained could not prepare {directory!r}: {problem}")
    error = _gather_and_write(local, items, files, staging, rank, group)
    extra: list[str] = []
    if rank == 0 and error is None:
        try:
            if view is not None and view.adapters_only:
                extra = view.save_config(staging)
            else:
                configs = hf_layout.configs_of(hf_layout.find_pretrained(_unwrap(model)))
                extra = hf_layout.save_configs(staging, *configs, dtype=hf_layout.main_dtype([i.entry for i in items]))
                hf_layout.write_index(staging, files)
        except Exception as exc:
            error = exc
    _raise_if_any_failed(error, group, rank, staging, "writing")
    if rank == 0:
        try:
            if view is not None and view.adapters_only:
                view.commit(staging, directory, files, extra)
            else:
                hf_layout.commit(staging, directory, files, extra)
        except Exception as exc:
            error = exc
    _raise_if_any_failed(error, group, rank, None, "publishing")
    return directory


# --- what this process holds ------------------------------------------------------------------


def _unwrap(model: nn.Module) -> nn.Module:
    from .._torch.sync import unwrap

    return unwrap(model)


def _local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This process's tensors under the unwrapped model's names (DTensors stay sharded)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}


def _describe(model: nn.Module, local: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What this process holds, in plain types, for the plan every process makes."""
    from .._torch.shard_ranges import flat_range

    runner = getattr(model, "_trainmesh_pipeline", None)
    module = _unwrap(model)
    stage_of: dict[str, int] = {}
    if runner is not None:
        for index, stage in zip(runner.indices, runner.stage_models):
            for name, _ in list(stage.named_parameters(remove_duplicate=False)) + list(stage.named_buffers()):
                stage_of.setdefault(name, index)
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    tensors = [
        (name, tuple(v.shape), str(v.dtype).split(".")[-1], flat_range(v), stage_of.get(name, 0), name in params)
        for name, v in local.items()
    ]
    ties = hf_layout.tie_groups_of(module, local)
    aliases = dict(getattr(runner, "aliases", None) or {})  # a pipeline stage's copy of a tied weight
    ties += [[alias, canonical] for alias, canonical in aliases.items() if alias in local]
    return {"tensors": tensors, "ties": ties}


# --- the plan (identical on every process) ----------------------------------------------------


def _plan(
    described: list[dict[str, Any]],
    max_bytes: int,
    dtype: torch.dtype | None,
    patterns: list[str],
    module: nn.Module | None = None,
) -> tuple[list[_Item], list[FilePlan]]:
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
    for name, source in written.items():
        meta = info[source]
        out_dtype = dtype if dtype is not None and meta["dtype"].is_floating_point else meta["dtype"]
        entry = Entry(name, tuple(meta["shape"]), out_dtype, meta["is_param"], order[source])
        runs = expert_runs(module, name, entry.shape) if module is not None else None
        for run_name, shape, offset in runs or [(name, entry.shape, 0)]:  # fused experts: transformers' names
            part = Entry(run_name, shape, out_dtype, meta["is_param"], order[source])
            items.append(_Item(part, source, sorted(meta["ranges"]), meta["dtype"], meta["ranges"], offset=offset))
    files = hf_layout.plan_files([i.entry for i in items], max_bytes)
    _assign_writers(items, files, len(described))
    by_name = {i.entry.name: i for i in items}
    ordered = [by_name[e.name] for f in files for e in f.entries]  # the order tensors travel in
    for item in ordered:
        item.pieces = _pieces(item)
    return ordered, files


def _assign_writers(items: list[_Item], files: list[FilePlan], world_size: int) -> None:
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


def _pieces(item: _Item) -> list[tuple[int, int, int]] | None:
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


# --- moving tensors -------------------------------------------------------------------------


class _Sink:
    """The writer's end of one file; after a failure it keeps receiving (senders must not hang)."""

    def __init__(self, path: str, plan: FilePlan):
        self.writer = hf_layout.SafetensorsWriter(path, plan)
        self.error: BaseException | None = None

    def put(self, entry: Entry, tensor: torch.Tensor) -> None:
        if self.error is None:
            try:
                _write_tensor(self.writer, entry, tensor)
            except Exception as exc:
                self.error = exc
                self.writer.abort()

    def close(self) -> BaseException | None:
        if self.error is None:
            try:
                self.writer.close(sync=False)  # fsynced by _Syncer, beside the next files' transfers
            except Exception as exc:
                self.error = exc
        return self.error


class _Syncer:
    """fsyncs this writer's closed files in a thread of its own. Every process walks the files in
    the same order, so an fsync in that walk held every other process at its next file (a file's
    fsync costs about as long as writing it); here it overlaps the transfers of the next files,
    and ``finish`` waits for the last. Nothing is published before every fsync returned."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []

    def submit(self, path: str) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainmesh-fsync")
        self._futures.append(self._pool.submit(_fsync_file, path))

    def finish(self) -> BaseException | None:
        error = None
        for future in self._futures:
            error = error or future.exception()
        if self._pool is not None:
            self._pool.shutdown()
        return error


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # raises where the write-back failed (EIO, ENOSPC): reported like a write error
    finally:
        os.close(fd)


def _write_tensor(writer: hf_layout.SafetensorsWriter, entry: Entry, tensor: torch.Tensor) -> None:
    """One tensor, or the next piece of one, into its file (a module-level step so tests can fail it)."""
    writer.write(entry.name, tensor.to(entry.dtype))


def _gather_and_write(
    local, items: list[_Item], files: list[FilePlan], staging: str, rank: int, group
) -> BaseException | None:
    """Every process walks the same list of rounds; each takes part where it holds or writes a tensor.

    A round is a run of files with distinct writers whose tensors all travel in runs: their
    pieces move at once (each writer receives its own file while sending its pieces of the
    others'), so the writers write in parallel and each holds at most one file in flight. A file
    with a tensor that must be gathered whole (a collective) is a round of its own, streamed
    tensor by tensor."""
    error: BaseException | None = None
    syncer = _Syncer()
    try:  # a failed collective still waits for the fsyncs already handed to the thread
        start = 0
        for round_files in _rounds(files, items):
            count = sum(len(plan.entries) for plan in round_files)
            round_items = items[start : start + count]
            start += count
            sink = None
            mine = next((plan for plan in round_files if plan.writer == rank), None)
            if mine is not None:
                try:
                    sink = _Sink(os.path.join(staging, mine.filename), mine)
                except Exception as exc:
                    error = exc
            if len(round_files) == 1 and any(item.pieces is None for item in round_items):
                for item in round_items:
                    _move(local, item, rank, group, sink)
            else:
                _exchange(local, round_items, rank, group, sink)
            if sink is not None:
                closed = sink.close()
                error = closed or error
                if closed is None:
                    syncer.submit(sink.writer.path)
    finally:
        synced = syncer.finish()  # always waited for: nothing is published before the bytes are durable
    return error or synced


def _rounds(files: list[FilePlan], items: list[_Item]) -> list[list[FilePlan]]:
    """Consecutive files grouped while their writers differ and every tensor travels in runs."""
    rounds: list[tuple[list[FilePlan], bool]] = []
    position = 0
    for plan in files:
        in_runs = all(item.pieces is not None for item in items[position : position + len(plan.entries)])
        position += len(plan.entries)
        if in_runs and rounds and rounds[-1][1] and all(other.writer != plan.writer for other in rounds[-1][0]):
            rounds[-1][0].append(plan)
        else:
            rounds.append(([plan], in_runs))
    return [plans for plans, _ in rounds]


def _exchange(local, round_items: list[_Item], rank: int, group, sink: _Sink | None) -> None:
    """Every piece of a round at once: isend what this process holds for other writers, irecv what its
    own file needs (posted in the same order on both ends, so gloo pairs them), then write its file
    in order as the pieces arrive."""
    from .._torch.shard_ranges import local_part

    sends, incoming = [], []
    for item in round_items:
        for sender, start, count in item.pieces:
            if rank == sender and rank != item.writer:
                part = _piece(local_part(local[item.source]), item, rank, start, count).contiguous()
                sends.append((dist.isend(part, dst=item.writer, group=group), part))
            elif rank == item.writer:
                if rank == sender:
                    incoming.append(
                        (item.entry, None, _piece(local_part(local[item.source]), item, rank, start, count))
                    )
                else:
                    buffer = torch.empty(count, dtype=item.source_dtype)
                    incoming.append((item.entry, dist.irecv(buffer, src=sender, group=group), buffer))
    for entry, request, tensor in incoming:
        if request is not None:
            request.wait()
        _put(sink, entry, tensor)
    for request, _ in sends:
        request.wait()


def _piece(flat: torch.Tensor, item: _Item, rank: int, start: int, count: int) -> torch.Tensor:
    """The elements ``[start, start + count)`` of ``item`` out of this process's flat run of its source: all
    of the run for a whole tensor; a slice of it for one expert of fused experts (``item.offset``)."""
    first = item.offset + start - item.ranges[rank][0]
    return flat[first : first + count]


def _move(local, item: _Item, rank: int, group, sink: _Sink | None) -> None:
    from .._torch.shard_ranges import full_tensor, local_part

    writing = rank == item.writer
    if item.pieces is not None:
        for sender, start, count in item.pieces:
            part = None
            if rank == sender:
                part = _piece(local_part(local[item.source]), item, rank, start, count)
                if writing:
                    _put(sink, item.entry, part)
                else:
                    dist.send(part.contiguous(), dst=item.writer, group=group)
            elif writing:
                part = torch.empty(count, dtype=item.source_dtype)
                dist.recv(part, src=sender, group=group)
                _put(sink, item.entry, part)
        return
    # Not in runs: the holders gather it whole (a collective on its mesh); one sends it on if need be.
    value = full_tensor(local[item.source]) if rank in item.holders else None
    if value is not None and (item.offset or value.numel() != item.entry.numel):  # one run of fused experts
        value = value.reshape(-1)[item.offset : item.offset + item.entry.numel].view(item.entry.shape)
    if item.writer not in item.holders:
        if rank == item.holders[0]:
            dist.send(value.contiguous(), dst=item.writer, group=group)
        elif writing:
            value = torch.empty(item.entry.shape, dtype=item.source_dtype)
            dist.recv(value, src=item.holders[0], group=group)
    if writing:
        _put(sink, item.entry, value)


def _put(sink: _Sink | None, entry: Entry, tensor: torch.Tensor) -> None:
    if sink is not None:  # None: this writer could not open its file; the data is dropped
        sink.put(entry, tensor)


# --- the communication around it ---------------------------------------------------------------


def _new_group():
    """A gloo group of every process (CPU tensors, whatever the training backend), or None alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    timeout = max(runtime.collective_timeout(), datetime.timedelta(minutes=10))  # a big tensor's write
    return dist.new_group(backend="gloo", timeout=timeout)


def _all_gather(obj: Any, group) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any, group) -> Any:
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _raise_if_any_failed(error: BaseException | None, group, rank: int, staging: str | None, what: str) -> None:
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    if group is not None:
        dist.all_reduce(failed, group=group)
    if failed.item() == 0:
        return
    if rank == 0 and staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
    mine = f" (this process: {error!r})" if error is not None else ""
    outcome = (
        "the folder may hold no loadable checkpoint"
        if staging is None
        else "nothing was published; the folder is as it was"
    )
    raise RuntimeError(
        f"save_pretrained failed while {what} on {failed.item()} process(es); {outcome}{mine}."
    ) from error
