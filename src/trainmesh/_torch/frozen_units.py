"""ZeRO-3 over a frozen base: frozen FSDP2 units gathered once per step, kept from forward to backward.

At stage 3 every unit is gathered before its forward, freed after it, and gathered again for its
backward. A frozen parameter (``requires_grad=False``: the base of a LoRA fine-tune) is still needed
in backward (the input gradient is ``grad_out @ W``), so a LoRA step all-gathered the whole base
twice, and ``benchmarks/finetune.py`` measured the ZeRO-3 LoRA step at 1.68x peft under DDP.

What this module does instead (``keep_frozen_gathered``): a unit that is wholly or mostly frozen
(trainable bytes at most ``MOSTLY_FROZEN`` of the frozen: a block of LoRA layers) is sharded with
``reshard_after_forward=False``: gathered once in forward (prefetched one block ahead), freed at the
end of its backward, its adapters' gradients reduce-scattered as before. In a unit with more trainable
bytes, its *maximal frozen sub-modules* (a LoRA layer's ``base_layer``, a norm) become one grouped FSDP2
unit, ``fully_shard([m1, m2, ...], reshard_after_forward=False)``, and the trainable rest stays ZeRO-3.
The price: by the end of forward a process holds the whole frozen base gathered in its gather dtype,
as a DDP replica would (``held_bytes``).

When the whole model is mostly frozen (a LoRA fine-tune), its adapters are left out of FSDP2
(``replicated_trainables``): replicated on every process as under DDP, their gradients averaged by one
flat all-reduce per backward (``replicated_grads.py``). Every kept unit is then wholly frozen as FSDP2
sees it and is kept whole: one all-gather per unit and step, no gradient collective per unit, and the
optimizer steps plain tensors. (Measured on ``benchmarks/finetune.py --quick``, whose blocks' adapters are
20% of their base, so each block was mixed: three all-gathers and a reduce-scatter per block a step, more
blocking collectives than regathering whole blocks, which is why the kept mode stepped slower there.)

A kept unit that holds no trainable parameter as FSDP2 sees it (every one when the adapters are replicated;
otherwise the grouped frozen sub-modules) is also kept *between* steps (``keep_between_steps``: FSDP2's
``set_reshard_after_backward(False)``): its weights never change, so the copy gathered by the first forward
stays valid, and later steps gather nothing for it, as a DDP replica is never gathered. The step's peak is
unchanged: at the loss the whole kept base is gathered already. What holds it between steps too is the
sentence ``decide`` writes. A ``state_dict``/``load_state_dict`` (checkpoints, the frozen fingerprint) reshards
first (FSDP2's own hooks), so a load into the shards is gathered again by the next forward; between steps
``model.parameters()`` shows these units' full tensors, not their shards.

A frozen module whose backward reads nothing is not kept at all (``released_after_forward``): a frozen
input embedding (``nn.Embedding``, its input token ids) computes no gradient, so autograd never calls back
into it. It becomes its own FSDP2 unit, resharded after its forward and never gathered in backward
(``set_unshard_in_backward(False)``, which also keeps FSDP2's implicit backward prefetch from the unit
after it off it). Left in the root (where it sat before), it stayed gathered from the first forward op to
the end of backward: at the peak (the loss's backward) with every kept block, and at a LoRA model's usual
size the largest single tensor (``benchmarks/finetune.py --size medium``: the embedding and the head are 57%
of the parameters). The other frozen units are kept: the head's backward needs its weight for the input
gradient, the blocks' frozen linears theirs, and the norms are tiny.

The choice is made from shapes and options only, so every process makes the same one (the units, and
so the collectives, must match): ``True`` and ``False`` are the user's; ``"auto"`` keeps them gathered
when the held bytes are at most ``KEEP_FROZEN_AUTO_BYTES``. The planner reads the resulting units
(``planner/step_measurement.py`` counts kept groups whole) and says when the choice was off.
"""

from __future__ import annotations

from torch import nn

# "auto" keeps a frozen base gathered up to this many bytes per process (a 1B-parameter base in bf16).
# A fixed figure, not the device's free memory: that differs between processes, and so would the units.
KEEP_FROZEN_AUTO_BYTES = 2 * 2**30
# Measured (benchmarks/finetune.py --size medium, 4 processes on 2 cores, a quiet machine): LoRA blocks kept
# whole stepped at 0.84x of gathering twice (rounds 0.81-0.85); on a loaded machine the split form (base apart,
# adapters still ZeRO-3) measured 1.02x: the count of blocking collectives, not their bytes, set the step.
MOSTLY_FROZEN = 1 / 8


def _is_frozen(module: nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def _mostly_frozen(module: nn.Module) -> bool:
    """A unit whose trainable bytes are at most ``MOSTLY_FROZEN`` of its frozen ones (a block of LoRA
    layers: adapters of a few percent) is kept whole: its adapters held to backward too cost little, and
    one all-gather a step replaces three (base + adapters in forward, adapters again in backward)."""
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
    return 0 < trainable <= MOSTLY_FROZEN * frozen


def _maximal_frozen(module: nn.Module, skip: set[int]) -> list[nn.Module]:
    """The frozen sub-modules of ``module`` whose parent is not wholly frozen (pre-order, the forward's
    order for transformers blocks), leaving out the subtrees in ``skip`` (nested shard units)."""
    found: list[nn.Module] = []
    for child in module.children():
        if id(child) in skip:
            continue
        if _is_frozen(child) and not any(id(m) in skip for m in child.modules()):
            found.append(child)
        else:
            found.extend(_maximal_frozen(child, skip))
    return found


def frozen_groups(units: list, excluded: set[int]) -> dict[int, list[nn.Module]]:
    """For each shard unit (by ``id``): the modules to keep gathered. A wholly frozen unit maps to itself;
    a mixed one to its maximal frozen sub-modules holding only parameters owned by it (none in
    ``excluded``: parameters FSDP2 ignores, e.g. experts, or shared with another unit)."""
    unit_ids = {id(u) for u in units if isinstance(u, nn.Module)}
    groups: dict[int, list[nn.Module]] = {}
    for unit in units:
        if not isinstance(unit, nn.Module):
            continue  # a grouped unit (stages 1-2 only) keeps everything gathered already
        if _is_frozen(unit) or _mostly_frozen(unit):
            groups[id(unit)] = [unit]
            continue
        nested = {id(m) for m in unit.modules() if m is not unit and id(m) in unit_ids}
        members = [m for m in _maximal_frozen(unit, nested) if not any(id(p) in excluded for p in m.parameters())]
        if members:
            groups[id(unit)] = members
    return groups


def released_after_forward(model: nn.Module, units: list, excluded: set[int]) -> list[nn.Module]:
    """The wholly frozen ``nn.Embedding`` modules outside every shard unit (they sit in the root) and holding
    no parameter in ``excluded`` (a tied weight, which the head's backward reads; one FSDP2 ignores). Its
    output needs no gradient (integer input, frozen weight), so its backward reads nothing: gathered for its
    forward only. Pre-order, the forward's order for transformers models."""
    inside = {
        id(sub) for unit in units for top in (unit if isinstance(unit, list) else [unit]) for sub in top.modules()
    }
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.Embedding)
        and id(m) not in inside
        and _is_frozen(m)
        and not any(id(p) in excluded for p in m.parameters())
    ]


def held_bytes(groups: dict[int, list[nn.Module]], gather_dtype) -> int:
    """What the kept groups hold gathered at the end of forward: every parameter whole (a tensor-parallel
    one counted at its global size: an upper bound, the same number on every process), at the dtype FSDP2
    gathers it in (``gather_dtype``, or as stored when None)."""
    seen: set[int] = set()
    total = 0
    for members in groups.values():
        for module in members:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    itemsize = gather_dtype.itemsize if gather_dtype is not None else p.element_size()
                    total += p.numel() * itemsize
    return total


# held_bytes counts the kept groups whole; those without a trainable parameter also stay between steps
_BETWEEN = "; the wholly frozen ones also between steps"


def decide(choice, groups: dict[int, list[nn.Module]], gather_dtype) -> tuple[bool, str]:
    """Whether to keep the frozen groups gathered, and the sentence that says so (``_trainmesh_memory``,
    the planner's notes)."""
    if not groups:
        return False, "off (no frozen sub-modules)"
    held = held_bytes(groups, gather_dtype)
    mib = f"{held / 2**20:.1f} MiB"
    if choice is True:
        return True, f"on ({len(groups)} units, {mib} held from forward to backward{_BETWEEN})"
    if choice is False:
        return False, f"off (keep_frozen_gathered=False; the frozen base is gathered again in backward, {mib})"
    if held <= KEEP_FROZEN_AUTO_BYTES:
        return True, (
            f"on (auto: {mib} held from forward to backward{_BETWEEN}, <= {KEEP_FROZEN_AUTO_BYTES / 2**30:.0f} GiB)"
        )
    return False, (
        f"off (auto: keeping it would hold {mib}, > {KEEP_FROZEN_AUTO_BYTES / 2**30:.0f} GiB; the frozen base "
        f"is gathered again in backward; keep_frozen_gathered=True overrides)"
    )


def keep_between_steps(units: list[tuple[str, nn.Module]]) -> list[str]:
    """Keep gathered between steps every FSDP2 unit of ``units`` (``zero.fsdp_units``: name, module) that is
    not resharded after its forward (a kept unit, or the root) and holds no trainable parameter: a frozen
    weight gathered once stays what its shards hold. Its names. Called only when the kept choice is on; a unit
    with a trainable parameter is left as it is (its optimizer steps the shards, its gathered copy goes stale)."""
    names = []
    for name, unit in units:
        groups = unit._get_fsdp_state()._fsdp_param_groups
        if not groups or any(g._reshard_after_forward for g in groups):
            continue  # nothing of its own, or a ZeRO-3 unit (a released embedding, a trainable unit)
        if any(fp.sharded_param.requires_grad for g in groups for fp in g.fsdp_params):
            continue
        unit.set_reshard_after_backward(False, recurse=False)
        names.append(name or "<root>")
    return names


def replicated_trainables(model: nn.Module, kept: dict[int, list[nn.Module]], excluded: set[int]) -> list[str]:
    """The names of the trainable parameters to replicate rather than shard: all of them (none in
    ``excluded``), when frozen groups are kept and the model is mostly frozen (trainable bytes at most
    ``MOSTLY_FROZEN`` of the frozen: replicated, their gradient and two Adam moments then cost at most
    half a byte per frozen byte on each process). Otherwise none: a model that trains more than that
    keeps ZeRO-3's sharding of what it trains."""
    if not kept:
        return []
    named = list(model.named_parameters())
    trainable = sum(p.numel() * p.element_size() for _, p in named if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for _, p in named if not p.requires_grad)
    if not 0 < trainable <= MOSTLY_FROZEN * frozen:
        return []
    return [n for n, p in named if p.requires_grad and id(p) not in excluded]
