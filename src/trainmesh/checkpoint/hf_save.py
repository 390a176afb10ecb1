"""``save_pretrained``: any trainmesh model, any layout, to the Hugging Face checkpoint layout.

Collective: every process calls it. The plan (which tensors, under which names, in which file,
written by which process) is made by the first process from every process's list of what it holds,
and broadcast with the staging folder's name. The file layout is transformers' own (its split by ``max_shard_size``, safetensors'
order of tensors inside a file), so the files are byte for byte what its ``save_pretrained`` writes.

* A file whose tensors are all held in contiguous runs of their row-major elements (ZeRO-3's dim-0
  shards, column-wise tensor-parallel weights, a pipeline stage's tensors, replicated ones) is
  written in place (``hf_save_direct``): its header, fixed by the plan, by its writer, and each
  run by the process holding it, at its byte offset. Nothing travels between processes; each
  writes about its own share of the model.
* A file with a tensor that must be gathered whole (a row-wise tensor-parallel weight: ``full_tensor``,
  a collective) goes through ``hf_save_transfer``: the pieces travel to the file's writer, which
  streams the file tensor by tensor and fsyncs it in a thread.

The plan is ``hf_save_plan``. A process that fails keeps taking part in every collective, so no
process hangs; every process then raises, and nothing is published (``hf_layout.commit``), which
happens only after every file was fsynced.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import runtime
from . import hf_layout
from .hf_save_direct import in_runs, write_in_place
from .hf_save_plan import by_file, make_plan as _plan
from .hf_save_transfer import gather_and_write as _gather_and_write


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
    planned = _plan_and_stage(model, described, directory, max_bytes, dtype, view) if rank == 0 else None
    items, files, staging, problem = _broadcast(planned, group)
    if problem is not None:  # made on the first process: the same error on every process
        raise problem
    error = _write_files(local, items, files, staging, rank, group)
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


def _plan_and_stage(model, described, directory, max_bytes, dtype, view) -> tuple:
    """The plan and the staging folder, made on the first process only and broadcast with the folder's
    name in the one object broadcast the save had before: the plan is a pure function of ``described``,
    so every process made the same one, and a process's first save builds transformers' conversion
    tables (``hf_expert_names.none_converted``: 0.05 s of CPU for the 0.09B Llama) on every process at once.
    A failure is told to everyone before any tensor moves: (None, None, None, the error to raise)."""
    try:
        items, files = _plan(
            described,
            max_bytes if view is None else view.max_bytes(max_bytes),
            dtype,
            hf_layout.tied_target_patterns(_unwrap(model)),
            _unwrap(model) if view is None else None,
        )
        if view is not None:
            view.rename(items, files)
    except Exception as exc:  # raised on every process, with its type where it pickles
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001  an unpicklable error would fail the broadcast on this process only
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return None, None, None, exc
    try:
        staging = hf_layout.prepare_staging(directory)
    except Exception as exc:
        return (
            None,
            None,
            None,
            RuntimeError(f"save_pretrained could not prepare {directory!r}: {type(exc).__name__}: {exc}"),
        )
    return items, files, staging, None


def _write_files(local, items, files, staging, rank, group) -> BaseException | None:
    """Files whose tensors are all held in runs: each process writes its runs in place
    (``hf_save_direct``, no transfer); the rest: pieces moved to each file's writer."""
    direct, moved = ([], []), ([], [])
    for plan, file_items in by_file(items, files):
        side = direct if in_runs(file_items) else moved
        side[0].extend(file_items)
        side[1].append(plan)
    error = None
    if direct[1]:
        error, _ = write_in_place(local, *direct, staging, rank)
    if moved[1]:
        error = _gather_and_write(local, *moved, staging, rank, group) or error
    return error


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
