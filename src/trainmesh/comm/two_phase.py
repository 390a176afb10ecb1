"""Two-phase compressed all-reduce: compressed reduce-scatter, then compressed all-gather.

As ZeRO++'s qgZ and 1-bit Adam's compressed all-reduce. The flat tensor is cut into N equal
rows (N = group size); row ``j`` is compressed (int8, one scale per chunk) and sent to rank
``j`` with one all-to-all; rank ``j`` decompresses the N rows it received, sums them, compresses
the sum again and all-gathers it. What crosses the wire is compressed in *both* phases::

    bytes each rank sends = (N-1) * row_payload  +  (N-1) * sum_payload  ~  2 (N-1)/N * numel * 1 byte

against ``2 (N-1)/N * numel * 4`` for a ring all-reduce in fp32: about 4x fewer at any N. (An
all-gather of every rank's whole int8 payload, the simple alternative, sends ``(N-1) * numel``
bytes: worse than fp32 from N = 8 on.)

Two processes (N = 2, e.g. two hosts' leaders) send exactly the same bytes with one all-gather
of each rank's whole compressed tensor (``(N-1) x numel`` = ``2 (N-1)/N x numel`` at N = 2),
so that is what runs there: one collective instead of two, one quantisation instead of two
(no requantised sum) and each rank decompresses and adds the N payloads itself, in rank order,
so every rank holds the same sum. From N = 3 on the two phases send fewer bytes and are used.

Error feedback (when the compressor has it) is kept twice, as 1-bit Adam does: each rank keeps
what its row payloads lost (keys ``"<key>|row j/N"``), and each row's owner keeps what the
requantised sum lost (``"<key>|sum/N"``); at N = 2, what the whole tensor lost
(``"<key>|row all/2"``). Keys name the group size: after a resize they do not apply and those
residuals restart from zero. :func:`exchange_keys` lists them.

``hierarchical_compressed_all_reduce`` runs the same exchange only across hosts: reduce-scatter
in fp32 inside each host (fast links), the compressed two-phase exchange of each 1/L shard
across hosts (the slow link), all-gather in fp32 inside the host.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trainmesh._torch.flat_collectives import all_gather_flat, reduce_scatter_flat
from trainmesh.compression.base import Compressor

from .packing import pack, unpack


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def two_phase_wire_bytes(numel: int, world: int, chunk: int | None) -> int:
    """Bytes one rank sends in :func:`two_phase_all_reduce` of ``numel`` elements with int8.

    The same formula the hook's accounting uses; tests compare it with the interface counters.
    """
    if world <= 1 or numel == 0:
        return 0
    if world == 2:  # one all-gather of the whole payload (see the module doc)
        return _aligned(numel) + _aligned(4 * math.ceil(numel / (chunk or numel)))
    row = math.ceil(numel / world)
    chunk = row if chunk is None else chunk
    payload = _aligned(row) + _aligned(4 * math.ceil(row / max(1, chunk)))  # int8 values + fp32 scales
    return 2 * (world - 1) * payload


def two_phase_all_reduce(flat: torch.Tensor, group, compressor: Compressor, key: str) -> tuple[torch.Tensor, int, int]:
    """Sum of ``flat`` (1-D, floating) over ``group`` through ``compressor`` in both phases.

    Returns ``(summed fp32 tensor, payload bytes, wire bytes this rank sent)``. The compressor
    must give row payloads whose layout depends only on the row's shape (int8's chunk scales do).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = flat.numel()
    if world == 1 or numel == 0:
        return flat.to(torch.float32).clone(), 0, 0
    if world == 2:
        return _gathered_all_reduce(flat, group, compressor, key)
    row = math.ceil(numel / world)
    padded = torch.zeros(world * row, dtype=torch.float32, device=flat.device)
    padded[:numel] = flat.reshape(-1)
    rows = padded.view(world, row)
    # Phase 1: compressed reduce-scatter (an all-to-all of compressed rows, summed on arrival).
    payloads = [compressor.compress(rows[j], key=f"{key}|row {j}/{world}") for j in range(world)]
    packed = [pack([p]) for p in payloads]
    size = packed[rank][0].numel()
    if any(buffer.numel() != size for buffer, _ in packed):
        raise RuntimeError(
            f"Compressor {compressor.name!r} gave rows of one shape payloads of different sizes; "
            "the two-phase exchange needs a layout that depends only on the shape."
        )
    received = torch.empty(world * size, dtype=torch.uint8, device=flat.device)
    dist.all_to_all_single(received, torch.cat([buffer for buffer, _ in packed]), group=group)
    layout = packed[rank][1]
    total = torch.zeros(row, dtype=torch.float32, device=flat.device)
    for source in range(world):
        (payload,) = unpack(received[source * size : (source + 1) * size], layout, [payloads[rank]])
        compressor.add_to(total, payload)
    # Phase 2: compress this rank's summed row again and all-gather it.
    mine = compressor.compress(total, key=f"{key}|sum/{world}")
    own, own_layout = pack([mine])
    gathered = torch.empty(world * own.numel(), dtype=torch.uint8, device=flat.device)
    all_gather_flat(gathered, own, group=group)
    out = torch.empty(world * row, dtype=torch.float32, device=flat.device)
    for source in range(world):
        (payload,) = unpack(gathered[source * own.numel() : (source + 1) * own.numel()], own_layout, [mine])
        out[source * row : (source + 1) * row] = compressor.decompress(payload).reshape(-1).to(torch.float32)
    # Payload: what this rank hands to the reduction (its compressed rows), as a ring all-reduce's
    # payload is the tensor handed in (accounting.py). Wire: what actually leaves this rank.
    payload_bytes = sum(p.nbytes() for p in payloads)
    wire = (world - 1) * (size + own.numel())
    return out[:numel], payload_bytes, wire


def exchange_keys(key: str, world: int) -> list[str]:
    """The compressor keys :func:`two_phase_all_reduce` uses over ``world`` processes."""
    if world <= 1:
        return []
    if world == 2:
        return [f"{key}|row all/2"]
    return [f"{key}|row {j}/{world}" for j in range(world)] + [f"{key}|sum/{world}"]


def _gathered_all_reduce(flat: torch.Tensor, group, compressor: Compressor, key: str) -> tuple[torch.Tensor, int, int]:
    """Two processes: all-gather each one's whole compressed tensor; each adds both, in rank order."""
    mine = compressor.compress(flat.reshape(-1).to(torch.float32), key=exchange_keys(key, 2)[0])
    own, layout = pack([mine])
    gathered = torch.empty(2 * own.numel(), dtype=torch.uint8, device=flat.device)
    all_gather_flat(gathered, own, group=group)
    parts = [
        compressor.decompress(payload).reshape(-1).to(torch.float32)
        for source in range(2)
        for payload in unpack(gathered[source * own.numel() : (source + 1) * own.numel()], layout, [mine])
    ]
    return parts[0] + parts[1], mine.nbytes(), own.numel()


def hierarchical_compressed_all_reduce(
    flat: torch.Tensor, intra_group, inter_group, compressor: Compressor, key: str, *, in_place: bool = False
) -> tuple[torch.Tensor, int, int]:
    """Sum of ``flat`` over intra x inter: fp32 inside hosts, two-phase compressed across them.

    Returns ``(sum, payload bytes, wire bytes this rank sent across hosts)``; in-host traffic is
    not counted as wire (it does not leave the host). ``in_place``: when ``flat`` is a contiguous
    fp32 tensor that splits evenly over the host, the sum is gathered into ``flat`` itself and
    returned (the DDP hook's bucket: two fewer copies of it per step).
    """
    local = dist.get_world_size(intra_group)
    numel = flat.numel()
    shard_len = math.ceil(numel / local)
    if in_place and flat.dtype == torch.float32 and flat.is_contiguous() and shard_len * local == numel:
        padded = flat.view(-1)
    else:
        padded = torch.zeros(shard_len * local, dtype=torch.float32, device=flat.device)
        padded[:numel] = flat.reshape(-1)
    if local > 1:
        shard = torch.empty(shard_len, dtype=torch.float32, device=flat.device)
        reduce_scatter_flat(shard, padded, op=dist.ReduceOp.SUM, group=intra_group)
    else:
        shard = padded
    summed, payload, wire = two_phase_all_reduce(shard, inter_group, compressor, key)
    if local > 1:
        all_gather_flat(padded, summed.contiguous(), group=intra_group)
    else:
        padded = summed
    return padded[:numel], payload, wire
