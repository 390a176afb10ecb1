"""Loading fused experts from the per-expert tensors transformers' own ``save_pretrained`` writes.

A transformers 5 MoE model holds its experts fused (``experts.gate_up_proj`` of shape
``(num_experts, 2 x intermediate, hidden)``, ``experts.down_proj`` of ``(num_experts, hidden,
intermediate)``), but its ``save_pretrained`` writes them back per expert by default
(``experts.{e}.gate_proj.weight``, ``...up_proj.weight``, ``...down_proj.weight``). Each of those is one
contiguous run of whole rows (dim 1) of expert ``e``'s slice of the fused tensor; ``hf_expert_names``
asks transformers' own ``revert_weight_conversion`` which names and where each run starts (the saving
direction), and this module reads it backwards.

``ExpertFiles`` wraps a ``WeightFiles``: every fused tensor whose runs are all in the files appears as
one more entry under the model's own name (full shape, dtype), and the per-expert tensors it consumes
disappear from ``keys()`` (so they are not "unexpected"). ``fill`` turns a process's piece of a fused
tensor into reads of just the runs that overlap it, each straight into its place in the piece: under
expert parallelism (or ZeRO-3's dim-0 shard) a process reads only its experts' tensors; a tensor-parallel
slice of dims 1 or 2 reads only that slice of each run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from .hf_expert_names import expert_runs
from .safetensors_reader import WeightFiles


@dataclass(frozen=True)
class FusedEntry:
    file: str  # the first run's file, for messages
    dtype: torch.dtype
    shape: tuple[int, ...]
    runs: tuple[tuple[str, int, int, int], ...]  # (name in the files, expert, first row, rows)


class ExpertFiles:
    """``files`` plus the fused tensors of ``fused``, under the model's names."""

    def __init__(self, files: WeightFiles, fused: dict[str, FusedEntry], renamed: dict[str, str] | None = None):
        self.files, self.fused, self.source = files, fused, files.source
        self.renamed = renamed or {}  # model name -> the file's (Mixtral's router: block_sparse_moe.gate)
        consumed = {run[0] for entry in fused.values() for run in entry.runs} | set(self.renamed.values())
        self.entries = {k: v for k, v in files.entries.items() if k not in consumed}
        self.entries.update(fused)
        self.entries.update({name: files.entries[stored] for name, stored in self.renamed.items()})

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> Iterable[str]:
        return self.entries.keys()

    def fill(self, items: list[tuple]) -> None:
        """As ``WeightFiles.fill``: a fused tensor's piece is filled from the runs overlapping it, all
        read in one pass with the plain tensors (file order, one descriptor per file)."""
        plain = []
        for item in items:
            name, tensor, local, offsets, shape = item
            if name in self.fused:
                plain += _pieces(self.fused[name], tensor, local, offsets, shape)
            elif name in self.renamed:
                plain.append((self.renamed[name], tensor, local, offsets, shape))
            else:
                plain.append(item)
        self.files.fill(plain)


def _pieces(entry: FusedEntry, tensor, local: torch.Tensor, offsets: tuple, shape: tuple) -> list[tuple]:
    """``(name in the files, tensor, view of local, offsets in that file tensor, shape)`` for every run
    overlapping the piece ``local`` at ``offsets`` of ``shape`` in the fused tensor."""
    pieces = []
    first_expert, experts = offsets[0], shape[0]
    row_lo, row_hi = offsets[1], offsets[1] + shape[1]
    for name, expert, first_row, rows in entry.runs:
        if not first_expert <= expert < first_expert + experts:
            continue  # another process's expert: not read
        lo, hi = max(row_lo, first_row), min(row_hi, first_row + rows)
        if lo >= hi:
            continue
        view = local[expert - first_expert, lo - row_lo : hi - row_lo]
        pieces.append((name, tensor, view, (lo - first_row, *offsets[2:]), (hi - lo, *shape[2:])))
    return pieces


def fused_entry(model: nn.Module, files: WeightFiles, name: str, shape: tuple[int, ...]) -> FusedEntry | None:
    """The fused tensor ``name`` of ``model`` as runs of per-expert tensors in ``files``, or None when
    transformers does not write it so, or the files do not hold every run with the shape it needs."""
    if len(shape) < 2:
        return None
    runs = expert_runs(model, name, shape)
    if not runs:
        return None
    per_expert, per_row = math.prod(shape[1:]), math.prod(shape[2:])
    found, dtypes = [], set()
    for written, run_shape, start in runs:
        stored = files.entries.get(written)
        if stored is None or math.prod(run_shape) % per_row or (start % per_expert) % per_row:
            return None
        rows = math.prod(run_shape) // per_row
        # the stored tensor must be (rows, *the fused tensor's trailing dims) so that a piece's slice of
        # dims 1.. is a region of it; a run stored in any other shape is left to the plain check
        if tuple(stored.shape) != (rows, *shape[2:]):
            return None
        dtypes.add(stored.dtype)
        found.append((written, start // per_expert, (start % per_expert) // per_row, rows))
    if len(dtypes) != 1 or sum(r[3] for r in found) != shape[0] * shape[1]:
        return None
    return FusedEntry(files.entries[found[0][0]].file, dtypes.pop(), tuple(shape), tuple(found))


def with_fused_experts(model: nn.Module, files):
    """``files`` as ``ExpertFiles`` when some of ``model``'s fused expert tensors are absent from them but
    their per-expert tensors are there; ``files`` itself otherwise (the check then names what is missing)."""
    if not isinstance(files, WeightFiles):
        return files
    fused, renamed = {}, {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        if name not in files and ".experts." in name:
            entry = fused_entry(model, files, name, tuple(tensor.shape))
            if entry is not None:
                fused[name] = entry
    if not fused:
        return files
    # a model whose experts transformers converts may rename other tensors on save too (Mixtral's
    # router, mlp.gate -> block_sparse_moe.gate): a plain rename with the same shape is read as is
    for name, tensor in state.items():
        if name not in files and name not in fused:
            stored = _renamed(model, name, tuple(tensor.shape))
            if stored is not None and stored in files and tuple(files.entries[stored].shape) == tuple(tensor.shape):
                renamed[name] = stored
    return ExpertFiles(files, fused, renamed)


def _renamed(model: nn.Module, name: str, shape: tuple[int, ...]) -> str | None:
    """The one name transformers writes ``name`` under when it only renames it, else None."""
    from transformers.core_model_loading import revert_weight_conversion

    try:
        probe = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
        out = revert_weight_conversion(model, {name: probe})
    except Exception:  # noqa: BLE001  a conversion this module cannot follow: the check names the key
        return None
    if len(out) != 1:
        return None
    ((stored, value),) = out.items()
    return stored if stored != name and torch.equal(value, probe) else None
