"""A compressed reduce-scatter for FSDP2 (ZeRO stages 2-3), through its custom-comm interface.

FSDP2 hands a reduce-scatter one flat input of ``N`` equal rows (row ``j``: the padded slices of
every gradient of the unit that rank ``j`` owns) and wants this rank's row reduced. Here each
rank compresses every row under its own key (``"<unit>/shard j of N"``, so error feedback keeps
per-destination residuals), then:

* summable (fp16, bf16): one reduce-scatter of the compressed rows, in the wire dtype;
* otherwise (int8, top-k): the packed payloads go out with one all-to-all (row ``j`` to rank
  ``j``), and each rank decompresses the N payloads of its row and sums them.

PowerSGD is not offered here: it factors each parameter's matrix, and the flat, padded rows
have no matrices left (``install_communication`` says so). The residuals' keys name the
world size: on a resume with a different number of processes they do not apply and restart
from zero (a warning says so); at stages 0-1 residuals are per parameter and are resized.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

try:  # FSDP2's custom-comm interface (present in torch 2.13), not exported publicly: hence the private path
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # an older torch: install_compressed_reduce_scatter says so
    ReduceScatter = object  # type: ignore[misc,assignment]

from trainmesh.compression.base import Compressed, Compressor

from .accounting import ByteCounter
from .allreduce_scatter import reduce_scatter_rows
from .ddp_hooks import KeepStateIfNonFinite, _nbytes, _pack, _unpack

KEY_MARK = "/shard "  # residual keys of this module contain it (world-size dependent)


def shard_key(unit: str, shard: int, world: int) -> str:
    return f"{unit or '<root>'}{KEY_MARK}{shard} of {world}"


class CompressedReduceScatter(ReduceScatter):
    """``fsdp_module.set_custom_reduce_scatter(CompressedReduceScatter(compressor, "layers.0"))``."""

    def __init__(self, compressor: Compressor, unit: str, counter: ByteCounter | None = None) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a trainmesh Compressor. Received: {type(compressor).__name__}")
        self.compressor = compressor
        self.unit = unit
        self.counter = counter if counter is not None else ByteCounter()

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise RuntimeError(
                f"A compressed reduce-scatter sums or averages; FSDP asked for {op!r} "
                "(a custom gradient divide factor is not supported with compression)."
            )
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = input_tensor.view(world, -1)
        keys = [shard_key(self.unit, j, world) for j in range(world)]
        guard = KeepStateIfNonFinite(self.compressor, keys, input_tensor)  # an overflow must not poison residuals
        payloads = [self.compressor.compress(rows[j], key=keys[j]) for j in range(world)]
        if self.compressor.summable:
            reduced = self._reduce_scatter_summable(payloads, group, rank)
        else:
            reduced = self._all_to_all(payloads, group, world, rank)
        guard.restore()
        if op == dist.ReduceOp.AVG:
            reduced = reduced / world
        output_tensor.copy_(reduced.reshape(output_tensor.shape))
        self.counter.add(sent=sum(p.nbytes() for p in payloads), dense=_nbytes(input_tensor))
        return None  # done synchronously (FSDP does not wait on the returned work)

    def _reduce_scatter_summable(self, payloads: list[Compressed], group, rank: int) -> torch.Tensor:
        names = list(payloads[0].tensors)
        reduced = {}
        for name in names:
            parts = [p.tensors[name].reshape(-1) for p in payloads]
            out = torch.empty_like(parts[rank])
            reduce_scatter_rows(out, torch.cat(parts), group)  # an all-reduce of the rows on gloo (see there)
            reduced[name] = out.view(payloads[rank].tensors[name].shape)
        return self.compressor.decompress(Compressed(reduced, payloads[rank].meta)).to(torch.float32)

    def _all_to_all(self, payloads: list[Compressed], group, world: int, rank: int) -> torch.Tensor:
        packed = [_pack([p]) for p in payloads]
        size = packed[rank][0].numel()
        if any(buffer.numel() != size for buffer, _ in packed):
            raise RuntimeError(
                f"Compressor {self.compressor.name!r} gave rows of equal size payloads of different "
                "sizes; an all-to-all needs a layout that depends only on the shape."
            )
        received = torch.empty(world * size, dtype=torch.uint8, device=packed[rank][0].device)
        dist.all_to_all_single(received, torch.cat([buffer for buffer, _ in packed]), group=group)
        _, layout = packed[rank]
        total = torch.zeros(payloads[rank].meta["numel"], dtype=torch.float32, device=received.device)
        for source in range(world):
            chunk = received[source * size : (source + 1) * size]
            (payload,) = _unpack(chunk, layout, [payloads[rank]])
            self.compressor.add_to(total, payload)
        return total


def install_compressed_reduce_scatter(model: torch.nn.Module, compressor: Compressor, counter: ByteCounter) -> int:
    """Give every FSDP unit of ``model`` a :class:`CompressedReduceScatter`; returns how many."""
    from torch.distributed.fsdp import FSDPModule

    if ReduceScatter is object or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise ValueError(
            f"Compression at ZeRO stages 2-3 needs FSDP2's custom reduce-scatter, which torch "
            f"{torch.__version__} lacks. Use zero_stage 0 or 1 with compression."
        )
    from trainmesh._torch.zero import fsdp_units

    units = fsdp_units(model)
    for name, module in units:
        module.set_custom_reduce_scatter(CompressedReduceScatter(compressor, name, counter))
    return len(units)
