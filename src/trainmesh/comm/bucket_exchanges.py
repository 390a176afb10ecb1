"""How the compressed DDP hook averages one (merged) bucket, one function per kind of compressor:
int8's two-phase exchange, a summable cast's all-reduce, PowerSGD's two all-reduces, and the
all-gather of packed payloads for everything else; each counts its bytes. ``ddp_hooks.py``'s
docstring says what each sends and why.

It exists apart from ``ddp_hooks.py`` so that the hook's state and dispatch read on their own, and
each exchange beside the others it is an alternative to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainmesh.compression.base import Compressed

from .packing import pack as _pack, unpack as _unpack
from .powersgd_exchange import powersgd_across_hosts, powersgd_all_reduce
from .two_phase import exchange_keys, hierarchical_compressed_all_reduce, two_phase_all_reduce

if TYPE_CHECKING:
    from .ddp_hooks import CompressionHookState


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _bucket_key(keys: list[str], numel: int) -> str:
    return f"{keys[0] if keys else ''}+{numel}"


def _all_keys(state: CompressionHookState, keys: list[str], flat: torch.Tensor) -> list[str]:
    if not state.two_phase:
        return keys
    group = state.inter_group if state.hierarchical else state.process_group
    return exchange_keys(_bucket_key(keys, flat.numel()), dist.get_world_size(group)) if state.world_size > 1 else []


# --- int8: two-phase compressed reduce-scatter + all-gather -----------------------------------
def _two_phase(state: CompressionHookState, keys: list[str], flat: torch.Tensor) -> torch.Tensor:
    key = _bucket_key(keys, flat.numel())
    if state.hierarchical:
        summed, payload, wire = hierarchical_compressed_all_reduce(
            flat, state.intra_group, state.inter_group, state.compressor, key, in_place=True
        )
    else:
        summed, payload, wire = two_phase_all_reduce(flat, state.process_group, state.compressor, key)
    dense = _nbytes(flat)
    state.counter.add(sent=payload, dense=dense, wire=wire, dense_wire=state.allreduce_wire(dense))
    return summed.div_(state.world_size)  # a fresh tensor, or the bucket itself (in_place above)


# --- summable: all-reduce the compressed tensors ----------------------------------------------
def _summable(state: CompressionHookState, keys: list[str], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    n = state.world_size
    payloads = [state.compressor.compress(g / n, key=k) for k, g in zip(keys, grads)]
    flat_by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for payload in payloads:
        for tensor in payload.tensors.values():
            flat_by_dtype.setdefault(tensor.dtype, []).append(tensor.reshape(-1))
    summed_by_dtype = {}
    for dtype, parts in flat_by_dtype.items():
        flat = torch.cat(parts)
        state.all_reduce(flat)
        summed_by_dtype[dtype] = iter(flat.split([p.numel() for p in parts]))
    out = []
    for payload in payloads:
        summed = {name: next(summed_by_dtype[t.dtype]).view(t.shape) for name, t in payload.tensors.items()}
        out.append(state.compressor.decompress(Compressed(summed, payload.meta)))
    sent, dense = sum(p.nbytes() for p in payloads), sum(_nbytes(g) for g in grads)
    state.counter.add(sent=sent, dense=dense, wire=state.allreduce_wire(sent), dense_wire=state.allreduce_wire(dense))
    return out


def _summable_bucket(state: CompressionHookState, grads: list[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
    """An elementwise, stateless summable compressor (fp16, bf16 without error feedback): the whole
    flat bucket compressed in one call, all-reduced, and the average written back into ``flat`` (the
    bucket's own buffer when unmerged, so DDP has nothing to copy). The same values, bit for bit, as
    :func:`_summable` gradient by gradient, without a compress, decompress and copy per gradient."""
    payload = state.compressor.compress(flat / state.world_size)
    for tensor in payload.tensors.values():
        state.all_reduce(tensor)
    flat.copy_(state.compressor.decompress(payload).reshape(flat.shape))
    sent, dense = payload.nbytes(), sum(_nbytes(g) for g in grads)
    state.counter.add(sent=sent, dense=dense, wire=state.allreduce_wire(sent), dense_wire=state.allreduce_wire(dense))
    return flat


# --- everything else: all-gather each rank's payload ------------------------------------------
def _check_same_layout(state: CompressionHookState, keys: list[str], size: int) -> None:
    """Once per bucket layout: every rank's packed payload must have the same size."""
    signature = tuple(keys)
    if signature in state._checked_layouts:
        return
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(state.world_size)]
    dist.all_gather(sizes, torch.tensor([size], dtype=torch.int64), group=state.process_group)
    if len({int(s) for s in sizes}) != 1:
        raise RuntimeError(
            f"Compressor {state.compressor.name!r} produced payloads of different sizes on different ranks "
            f"({[int(s) for s in sizes]} bytes) for the same gradients: all-gather needs a payload layout that "
            "depends only on the gradient shapes (e.g. a fixed k for top-k)."
        )
    state._checked_layouts.add(signature)


def _gathered(
    state: CompressionHookState, keys: list[str], grads: list[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The average of every rank's decompressed ``grads``, flat in their order (a bucket's layout).

    ``out`` (the bucket's own buffer, which ``grads`` view) receives it when its dtype is the sum's:
    the payloads are packed first, so the gradients are read by then, and DDP then has nothing to copy back."""
    compressor = state.compressor
    payloads = [compressor.compress(g, key=k) for k, g in zip(keys, grads)]
    packed, layout = _pack(payloads)
    _check_same_layout(state, keys, packed.numel())
    gathered = [torch.empty_like(packed) for _ in range(state.world_size)]
    dist.all_gather(gathered, packed, group=state.process_group)
    dtype = torch.float32 if grads[0].dtype in (torch.float16, torch.bfloat16) else grads[0].dtype
    numels = [g.numel() for g in grads]
    if out is not None and out.dtype == dtype and out.is_contiguous() and out.numel() == sum(numels):
        total = out.view(-1).zero_()
    else:
        total = torch.zeros(sum(numels), dtype=dtype, device=grads[0].device)
    pieces = total.split(numels)
    for buffer in gathered:
        for piece, payload in zip(pieces, _unpack(buffer, layout, payloads)):
            compressor.add_to(piece, payload)
    dense = sum(_nbytes(g) for g in grads)
    # A ring all-gather: every peer's payload passes through (and on from) this rank once.
    state.counter.add(
        sent=sum(p.nbytes() for p in payloads),
        dense=dense,
        wire=(state.world_size - 1) * packed.numel(),
        dense_wire=state.allreduce_wire(dense),
    )
    return total.div_(state.world_size)


# --- PowerSGD: two all-reduces (P, then Q) per bucket; across hosts only when hierarchical ------
def _powersgd(
    state: CompressionHookState, keys: list[str], grads: list[torch.Tensor], flat: torch.Tensor
) -> torch.Tensor:
    if state.hierarchical:
        averaged, sent, wire = powersgd_across_hosts(state, keys, grads, flat)
    else:
        averaged, sent, wire = powersgd_all_reduce(state, keys, grads)
    dense = sum(_nbytes(g) for g in grads)
    state.counter.add(sent=sent, dense=dense, wire=wire, dense_wire=state.allreduce_wire(dense))
    return averaged
