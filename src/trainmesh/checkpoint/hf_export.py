"""``trainmesh export``: a sharded training checkpoint to the Hugging Face layout, offline.

One process, no process group. The checkpoint's DCP metadata gives every model tensor's full
shape and dtype; each is then read alone into a tensor of that shape (DCP reads just that
tensor's chunks, from however many processes wrote them) and streamed into its output file
(``hf_layout``), so memory holds one tensor at a time, whatever the model's size.

A training checkpoint holds tensors only. The model's ``config.json`` comes from ``config``
(a folder holding one, e.g. the Hugging Face folder training started from, or the JSON file
itself), else from the checkpoint's folder or the one above it. With a config, the model is
built on the meta device to learn its names and tied weights (written once, as transformers
does), and a tensor the model needs but the checkpoint lacks is an error naming it. Without
one, every model tensor is written under its checkpoint name, and the output has no
``config.json`` (``from_pretrained`` then needs one next to it).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import torch

from . import hf_layout, integrity, retention
from .hf_layout import Entry

_MODEL_PREFIX = "model."


def resolve_checkpoint(path: str | os.PathLike) -> tuple[str, str]:
    """(DCP folder, checkpoint folder) for a step folder, a CheckpointManager folder (its latest
    complete checkpoint) or a bare DCP folder."""
    path = os.fspath(path)
    if os.path.isdir(os.path.join(path, "dcp")):
        if integrity.read_marker(path) is None:
            raise ValueError(
                f"{path!r} is not a complete checkpoint (no {integrity.MARKER}): a save that "
                f"did not finish. Received: checkpoint={path!r}"
            )
        return os.path.join(path, "dcp"), path
    entries = retention.complete_entries(path)
    if entries:
        return os.path.join(entries[-1].path, "dcp"), entries[-1].path
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path, path
    raise ValueError(
        f"No trainmesh checkpoint at {path!r}: expected a step folder (dcp/ + {integrity.MARKER}), "
        f"a checkpoint manager's folder of step_* folders, or a DCP folder (.metadata)."
    )


def load_config(config: str | os.PathLike | None, checkpoint_dir: str) -> tuple[Any, Any]:
    """(config, generation config or None) from ``config`` or next to the checkpoint; (None, None)."""
    import transformers

    if config is not None:
        config = os.fspath(config)
        if not (os.path.isfile(config) or os.path.isfile(os.path.join(config, "config.json"))):
            raise ValueError(f"config must be a folder holding config.json or a JSON file. Received: config={config!r}")
        candidates = [config]
    else:
        candidates = [checkpoint_dir, os.path.dirname(os.path.abspath(checkpoint_dir))]
    for candidate in candidates:
        folder = os.path.dirname(candidate) if os.path.isfile(candidate) else candidate
        if not (os.path.isfile(candidate) or os.path.isfile(os.path.join(candidate, "config.json"))):
            continue
        model_config = transformers.AutoConfig.from_pretrained(candidate)
        generation = None
        if os.path.isfile(os.path.join(folder, "generation_config.json")):
            generation = transformers.GenerationConfig.from_pretrained(folder)
        return model_config, generation
    return None, None


def _meta_model(config: Any) -> torch.nn.Module:
    """The model ``config`` describes, on the meta device (no memory): its names and ties."""
    import transformers

    architecture = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, architecture, None) if architecture else None
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            return transformers.AutoModel.from_config(config)


def _stored_tensors(reader) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = reader.read_metadata()
    return {
        key[len(_MODEL_PREFIX) :]: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(_MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }


def _choose(stored: dict[str, Any], template: torch.nn.Module | None, where: str) -> dict[str, str]:
    """Written name -> checkpoint name, in the model's order (tied weights once)."""
    if template is None:
        return {name: name for name in stored}
    expected = list(template.state_dict())
    order = {name: i for i, name in enumerate(expected)}
    patterns = hf_layout.tied_target_patterns(template)
    chosen = {name: [name] for name in expected}
    for group in hf_layout.merge_groups(hf_layout.tie_groups_of(template, expected)):
        keep = hf_layout.kept_name(group, patterns, order)
        for name in group:
            chosen.pop(name, None)
        chosen[keep] = sorted(group, key=lambda n: (n != keep, order[n]))  # any copy will do
    out = {}
    for name in sorted(chosen, key=order.get):
        found = [n for n in chosen[name] if n in stored]
        if not found:
            raise ValueError(
                f"The checkpoint {where} has no tensor {name!r}, which the model of the config needs "
                f"({type(template).__name__}). Is it this model's checkpoint?"
            )
        out[name] = found[0]
    extra = sorted(set(stored) - set(expected))
    if extra:
        warnings.warn(
            f"{len(extra)} checkpoint tensor(s) are not part of {type(template).__name__} and are not "
            f"written: {extra[:5]}{' ...' if len(extra) > 5 else ''}",
            RuntimeWarning,
            stacklevel=3,
        )
    return out


def export_pretrained(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: str | os.PathLike | None = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
) -> str:
    """Convert a trainmesh checkpoint's model into the Hugging Face layout in ``out_dir``.

    >>> export_pretrained("runs/exp1/ckpt", "runs/exp1/hf", config="models/base")   # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp

    max_bytes = hf_layout.parse_size(max_shard_size)
    dcp_dir, checkpoint_dir = resolve_checkpoint(checkpoint)
    from .._torch.dcp_reader import SafeFileSystemReader

    reader = SafeFileSystemReader(dcp_dir)  # nothing in the checkpoint runs code
    stored = _stored_tensors(reader)
    if not stored:
        raise ValueError(f"The checkpoint {checkpoint_dir!r} holds no model tensors.")
    model_config, generation = load_config(config, checkpoint_dir)
    template = _meta_model(model_config) if model_config is not None else None
    if template is None:
        warnings.warn(
            "No config.json given or found next to the checkpoint: writing the weights only. Pass "
            "--config (a folder holding config.json) for a folder from_pretrained loads.",
            RuntimeWarning,
            stacklevel=2,
        )
    sources = _choose(stored, template, checkpoint_dir)
    params = {n for n, _ in template.named_parameters(remove_duplicate=False)} if template is not None else None
    entries = []
    for position, (name, source) in enumerate(sources.items()):
        meta = stored[source]
        out_dtype = dtype if dtype is not None and meta.properties.dtype.is_floating_point else meta.properties.dtype
        entries.append(Entry(name, tuple(meta.size), out_dtype, params is None or name in params, position))
    files = hf_layout.plan_files(entries, max_bytes)

    def fetch(entry: Entry) -> torch.Tensor:
        meta = stored[sources[entry.name]]
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with warnings.catch_warnings():  # DCP warns on every load without a process group: we mean it
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": {sources[entry.name]: tensor}}, storage_reader=reader, no_dist=True)
        return tensor

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    staging = hf_layout.prepare_staging(out_dir)
    try:
        for plan in files:
            hf_layout.write_file(os.path.join(staging, plan.filename), plan, fetch)
        configs = hf_layout.configs_of(template)
        extra = hf_layout.save_configs(
            staging, model_config, generation or configs[1], configs[2], dtype=hf_layout.main_dtype(entries)
        )
        hf_layout.write_index(staging, files)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    hf_layout.commit(staging, out_dir, files, extra)
    return out_dir
