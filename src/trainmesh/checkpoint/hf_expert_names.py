"""The per-expert names transformers' own ``save_pretrained`` writes for a fused-experts model.

transformers 5 stacks a MoE layer's experts into fused tensors when it loads (``experts.gate_up_proj``
of shape ``(num_experts, 2 x intermediate, hidden)``), and by default converts them back on save
(``save_original_format=True``: ``experts.{e}.gate_proj.weight``, ``...up_proj.weight``, ...). Each of
those per-expert tensors is one contiguous run of the fused tensor (expert ``e``'s rows, a slice of
them), so ``hf_save`` writes it like any tensor, from the pieces its holders have, at an offset into the
fused tensor: no process gathers the fused tensor for this.

Which names and where their runs start is asked of transformers' own ``revert_weight_conversion``: once
with a meta tensor of the full shape (the names of every expert), once with expert 0's elements numbered
0, 1, 2, ... (each output's numbers say where its run starts, and that it is one run). A tensor whose
conversion is anything else is left under its own name.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def expert_runs(module: nn.Module, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], int]] | None:
    """``[(written name, shape, flat offset into the fused tensor)]`` in transformers' order, or None
    when ``name`` is not converted on save (or not into runs of whole-expert slices)."""
    if len(shape) < 2 or not _converts(module):
        return None
    from transformers.core_model_loading import revert_weight_conversion

    try:
        names = revert_weight_conversion(module, {name: torch.empty(shape, device="meta")})
        if set(names) == {name}:
            return None
        per_expert = math.prod(shape[1:])
        probe = torch.arange(per_expert, dtype=torch.int64).view(1, *shape[1:])
        first = revert_weight_conversion(module, {name: probe})
    except Exception:  # noqa: BLE001  any conversion this module cannot follow: keep the fused name
        return None
    starts = {}
    for out_name, tensor in first.items():
        flat = tensor.reshape(-1)
        start = int(flat[0]) if flat.numel() else 0
        if not torch.equal(flat, torch.arange(start, start + flat.numel())):
            return None  # not one run of the expert's elements
        starts[_EXPERT_INDEX.sub(".experts.0.", out_name, count=1)] = start
    runs = []
    for out_name, tensor in names.items():
        match = _EXPERT_INDEX.search(out_name)
        base = _EXPERT_INDEX.sub(".experts.0.", out_name, count=1)
        if match is None or base not in starts:
            return None
        runs.append((out_name, tuple(tensor.shape), int(match.group(1)) * per_expert + starts[base]))
    return runs


def none_converted(module: nn.Module | None, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether transformers' save converts none of these tensors, from one call over all of them on
    meta tensors: then ``expert_runs``' per-tensor probes (0.13 s of CPU for a 57-tensor Llama, on
    every process of every save) are skipped."""
    if module is None or not _converts(module):
        return True
    from transformers.core_model_loading import revert_weight_conversion

    try:
        names = revert_weight_conversion(module, {n: torch.empty(s, device="meta") for n, s in shapes.items()})
    except Exception:  # noqa: BLE001  let the per-tensor probes decide, as before
        return False
    return set(names) == set(shapes)


def _converts(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)
