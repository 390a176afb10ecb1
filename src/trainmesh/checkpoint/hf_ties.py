"""Which name a tied weight is written under: the groups of names that are one tensor, merged
across processes, and transformers' rule for the name kept (the others are re-tied on load).

It exists apart from ``hf_layout.py`` because both the collective save (``hf_save_plan``) and the
offline export (``hf_export``) decide it, before any file is planned.
"""

from __future__ import annotations

import re
from typing import Iterable

from torch import nn


def tied_target_patterns(model: nn.Module | None) -> list[str]:
    """The names transformers re-ties on load (``_tied_weights_keys`` of every submodule)."""
    patterns: list[str] = []
    for name, module in model.named_modules() if model is not None else ():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        patterns += [f"{name}.{key}" if name else key for key in tied]  # a dict (v5) or a list: its keys
    return patterns


def tie_groups_of(module: nn.Module, names: Iterable[str]) -> list[list[str]]:
    """Groups of ``names`` that are one parameter or buffer of ``module`` under several names."""
    wanted, by_id = set(names), {}
    tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        if name in wanted:
            by_id.setdefault(id(tensor), []).append(name)
    return [group for group in by_id.values() if len(group) > 1]


def merge_groups(groups: Iterable[Iterable[str]]) -> list[set[str]]:
    """Union of overlapping name groups (ties seen by different processes)."""
    merged: list[set[str]] = []
    for group in groups:
        group = set(group)
        overlapping = [m for m in merged if m & group]
        for m in overlapping:
            group |= m
            merged.remove(m)
        merged.append(group)
    return merged


def kept_name(group: set[str], patterns: list[str], order: dict[str, int]) -> str:
    """transformers' rule: drop the names matching a tied-weights pattern, keep the first of the rest."""
    ordered = sorted(group, key=lambda n: (order.get(n, len(order)), n))
    free = [n for n in ordered if not any(re.search(p, n) for p in patterns)]
    return (free or ordered)[0]
