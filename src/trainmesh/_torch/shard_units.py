"""Which sub-modules FSDP2 shards as one unit (gathered at once), for ``zero.py``.

By default each transformer block (each child of the model's first non-empty ``nn.ModuleList``); the
root is always a unit too and holds the rest (embedding, final norm, head). At stages 1-2 on CPU
processes consecutive blocks are grouped into units of up to ``BLOCKING_BUCKET_BYTES``, since every
unit there is one point where all processes wait for the slowest.

Why the input embedding stays in the root at stage 3 (transformers' FSDP2 gives it a unit of its own,
gathered for its forward and again in backward): tried on ``benchmarks/big_model.py``'s quick Llama
(0.09B, untied 94 MiB embedding and head, 4 gloo processes), the first step from the checkpoint used
more CPU with it (2.72 s against 2.59 s, the busiest process, medians of 2 rounds: one more 94 MiB all-gather in
backward) and its peak RSS moved by less than the rounds' spread (-15 MiB median, +52 and -83 MiB).
The embedding's forward is too short to hide the block-0 gather behind it, so forward gained nothing.
"""

from __future__ import annotations

from torch import nn


def _param_bytes(module: nn.Module, skip: set[int]) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in skip)


def _first_module_list(model: nn.Module) -> nn.ModuleList | None:
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            return module
    return None


def _units_by_size(model: nn.Module, threshold: int) -> list[nn.Module]:
    """Bottom-up, as FSDP1's size policy: a module becomes a unit when the parameters it holds
    that no unit below it already holds exceed ``threshold`` bytes."""
    units: list[nn.Module] = []
    claimed: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is not model and _param_bytes(module, claimed) > threshold:
            units.append(module)
            claimed.update(id(p) for p in module.parameters())

    visit(model)
    return units


def select_shard_units(model: nn.Module, shard_unit) -> tuple[list[nn.Module], bool]:
    """The sub-modules to shard as their own FSDP unit (children before parents; the root is
    always a unit too and is not listed), and whether their order is the execution order.

    * ``None``: each child of the first non-empty ``nn.ModuleList`` (the transformer blocks of
      most models); without one, by size with a threshold of 1/8 of the model's bytes (so at
      most ~8 units of comparable size; a tiny model stays one unit).
    * a class or tuple of classes: every instance is a unit (e.g. each ``Block``).
    * an int: a byte threshold (see ``_units_by_size``).
    """
    if shard_unit is None:
        blocks = _first_module_list(model)
        if blocks is not None:
            return list(blocks), True
        return _units_by_size(model, max(_param_bytes(model, set()) // 8, 1)), False
    if isinstance(shard_unit, int):
        return _units_by_size(model, shard_unit), False
    units = [m for m in model.modules() if m is not model and isinstance(m, shard_unit)]
    # A unit nested in another is fine for FSDP2 only when the inner one is sharded first.
    units.sort(key=lambda m: -_depth(model, m))
    in_order = [m for m in model.modules() if any(m is u for u in units)]
    return units, _no_nesting(units) and len(in_order) == len(units)


# DDP's default gradient bucket (``bucket_cap_mb=25``): the bytes worth one blocking collective.
BLOCKING_BUCKET_BYTES = 25 * 2**20


def group_for_blocking_collectives(
    units: list[nn.Module], max_bytes: int = BLOCKING_BUCKET_BYTES
) -> list[nn.Module | list[nn.Module]]:
    """Consecutive units merged into groups of at most ``max_bytes`` parameter bytes (a unit larger
    than that stays alone); a group of one is the module itself, a larger one the list
    ``fully_shard`` takes as one unit.

    Why, at stages 1-2 on CPU processes: there are no streams there, so FSDP2 runs each unit's
    reduce-scatter inside backward and backward waits until every process has reached it; each unit
    is one point where all processes wait for the slowest. Stages 1-2 keep every unit gathered
    from its forward to its backward, so a larger unit costs no parameter memory, only its
    gradient before the reduce (as a larger DDP or DeepSpeed bucket does). Measured on the
    zero_memory benchmark's quick GPT (4 blocks of 3 MB, 4 processes on 2 cores, bf16): stage 1 at
    0.129-0.130 s/step as one group against 0.17-0.18 with a unit per block."""
    groups: list[list[nn.Module]] = []
    size = 0
    for unit in units:
        unit_bytes = _param_bytes(unit, set())
        if groups and size + unit_bytes <= max_bytes:
            groups[-1].append(unit)
            size += unit_bytes
        else:
            groups.append([unit])
            size = unit_bytes
    return [group[0] if len(group) == 1 else group for group in groups]


def first_of(unit: nn.Module | list[nn.Module]) -> nn.Module:
    """The module that stands for a unit in FSDP2's prefetch lists (every module of a grouped unit
    shares its one parameter group)."""
    return unit[0] if isinstance(unit, list) else unit


def _depth(root: nn.Module, target: nn.Module) -> int:
    for name, module in root.named_modules():
        if module is target:
            return name.count(".") + 1
    return 0


def _no_nesting(units: list[nn.Module]) -> bool:
    ids = {id(u) for u in units}
    return all(not any(id(m) in ids for m in u.modules() if m is not u) for u in units)


def check_uniform_trainable_dtypes(units: list, model: nn.Module) -> None:
    """FSDP2 reduce-scatters a unit's gradients as one flat tensor: its trainable parameters must share
    a dtype (frozen ones may differ). Said here, naming the unit, not at the first backward."""
    claimed: set[int] = set()
    for unit in [*units, model]:  # children first: a parameter belongs to the innermost unit holding it
        modules = unit if isinstance(unit, list) else [unit]
        params = [p for m in modules for p in m.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        dtypes = sorted({str(p.dtype) for p in params if p.requires_grad})
        if len(dtypes) > 1:
            name = next((n for n, m in model.named_modules() if m is modules[0]), "") or "the root module"
            raise ValueError(
                f"ZeRO reduces each shard unit's gradients in one dtype; unit {name!r} holds "
                f"trainable parameters in {dtypes}. Cast them to one dtype, or freeze the odd ones. "
                f"Received: trainable dtypes {dtypes}"
            )
