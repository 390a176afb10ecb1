"""A DDP communication hook that averages gradients through a ``trainmesh.compression`` compressor.

Per bucket, by kind of compressor:

* int8 (and any compressor with ``two_phase = True`` state here): the two-phase compressed
  all-reduce of ``two_phase.py`` on the bucket's flat buffer: compressed reduce-scatter (one
  all-to-all of int8 rows), local sum, compressed all-gather; about 4x fewer bytes on the wire
  than an fp32 ring all-reduce at any number of processes. Across hosts, only the inter-host
  step is compressed (fp32 inside a host). Residuals are keyed by the bucket's first parameter
  name and size (``"<name>+<numel>|row j/N"``; ``"...|row all/2"`` between two processes or
  hosts, where one all-gather sends the same bytes: ``two_phase.py``).
* summable (fp16, bf16): the compressed tensors are flattened and all-reduced (SUM; optionally
  hierarchically), decompressed and divided by N. As torch's ``fp16_compress_hook``, gradients
  are divided by N *before* the cast, so a half-precision sum of N gradients cannot overflow.
  Without error feedback (a cast keeps no state then), the whole bucket is cast in one call and
  the average written back into DDP's buffer (``_summable_bucket``): the same bits, fewer copies.
* PowerSGD: the exact distributed algorithm (Vogels et al. 2019, as torch's ``powerSGD_hook``):
  all-reduce ``P = M Q``, orthogonalize, all-reduce ``Q = M^T P``; residual ``M - P Q^T``. The
  compressor holds the residuals and warm-start ``Q`` by parameter name, so they checkpoint.
  Across hosts, only each host's local rank 0 runs it, on its host's fp32 sum, and broadcasts
  the factors inside the host (``powersgd_exchange.py``: the same result, far fewer collectives).
* anything else (top-k, a user's compressor): a sparse exchange: each gradient compressed under
  its parameter's name (residuals follow the parameter, not DDP's bucket layout), the bucket's
  payload packed into one byte buffer and all-gathered; each rank decompresses every rank's
  payload and averages. Honest bytes: each rank sends ``(N-1) x payload`` (ring all-gather),
  against ``2 (N-1)/N x 4 x numel`` for fp32, so top-k, ~6 bytes per kept entry (16-bit block
  offset, fp32 value), beats dense on the wire only when ``ratio < 4/(3N)`` (``2/N`` with fp16
  values, 4 bytes per entry): 1% wins up to N = 133 (200).

The collectives run on a background thread (:class:`~trainmesh.comm.bucket_worker.BucketWorker`)
and the hook returns a pending future, so communication overlaps the rest of backward. A
non-finite gradient (an fp16 overflow, a NaN loss the Trainer then skips) would poison the
error-feedback state for good; such a step leaves the compressor's state as it was before it
(:class:`KeepStateIfNonFinite`), as if it had not happened, which is what the skipped step is.

Bytes: ``ByteCounter`` gets the payload (the figure compression papers report) and the bytes
this rank actually sends (``wire``; across hosts only, when hierarchical), next to what DDP's
fp32 ring all-reduce of the same gradients would send.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from trainmesh.compression.base import Compressor

from .accounting import ByteCounter, ring_wire_bytes  # noqa: F401 (ring_wire_bytes: imported from here too)
from .bucket_exchanges import _all_keys, _gathered, _nbytes, _powersgd, _summable, _summable_bucket, _two_phase
from .bucket_worker import BucketMerger, BucketWorker
from .dense_hook import DenseHookState, dense_allreduce_hook
from .nonfinite_guard import KeepStateIfNonFinite, all_finite
from .packing import pack as _pack, unpack as _unpack  # noqa: F401 (reduce_scatter imports them from here)


class CompressionHookState:
    """What :func:`compressed_allreduce_hook` needs: the compressor, group, names and counter.

    ``all_reduce`` sums a tensor in place over the group (default ``dist.all_reduce``; the
    Trainer passes hierarchical all-reduce across hosts); used for summable compressors and
    PowerSGD. ``intra_group``/``inter_group`` (both or neither): the host groups, for the
    two-phase int8 exchange across hosts only. ``overlap``: run the collectives on a background
    thread (off: inline, the future already complete). ``bucket_bytes``: merge DDP buckets up to
    this size before communicating (0: as DDP cuts them).
    """

    def __init__(
        self,
        compressor: Compressor,
        process_group: Any,
        param_names: dict[int, str],
        *,
        counter: ByteCounter | None = None,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
        intra_group: Any = None,
        inter_group: Any = None,
        overlap: bool = True,
        bucket_bytes: int = 0,
        two_phase: bool = True,
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a trainmesh Compressor. Received: {type(compressor).__name__}")
        if (intra_group is None) != (inter_group is None):
            raise ValueError(
                "intra_group and inter_group go together (both or neither). "
                f"Received: intra_group={intra_group!r}, inter_group={inter_group!r}"
            )
        self.compressor = compressor
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.param_names = param_names
        self.counter = counter if counter is not None else ByteCounter()
        self.all_reduce = all_reduce or (lambda tensor: dist.all_reduce(tensor, group=process_group))
        self.intra_group, self.inter_group = intra_group, inter_group
        self.two_phase = two_phase and compressor.name == "int8"
        self.worker = BucketWorker() if overlap else None
        self.merger = (
            BucketMerger(self.worker, lambda parts: _reduce_parts(self, parts), bucket_bytes)
            if self.worker is not None
            else None
        )
        self._checked_layouts: set[tuple[str, ...]] = set()

    @property
    def hierarchical(self) -> bool:
        return self.inter_group is not None

    def allreduce_wire(self, nbytes: int) -> int:
        """Bytes this rank sends for an all-reduce of ``nbytes`` through ``self.all_reduce``
        (across hosts only, when hierarchical: a 1/L shard all-reduced over the hosts)."""
        if self.hierarchical:
            local, hosts = dist.get_world_size(self.intra_group), dist.get_world_size(self.inter_group)
            return ring_wire_bytes(-(-nbytes // local), hosts)
        return ring_wire_bytes(nbytes, self.world_size)

    @classmethod
    def for_model(
        cls, ddp_model: torch.nn.parallel.DistributedDataParallel, compressor: Compressor, **kwargs: Any
    ) -> "CompressionHookState":
        names = {id(p): name for name, p in ddp_model.module.named_parameters()}
        # DDP all-reduces the unused-parameter map from autograd's thread when it looks for unused
        # parameters: a second thread issuing collectives could then order them differently per rank.
        if getattr(ddp_model, "find_unused_parameters", False):
            kwargs["overlap"] = False
        return cls(compressor, ddp_model.process_group, names, **kwargs)


def compressed_allreduce_hook(state: CompressionHookState, bucket):  # -> Future[Tensor]
    """Register with ``ddp_model.register_comm_hook(state, compressed_allreduce_hook)``.

    (No annotations on ``bucket`` and the return: DDP compares them to the real types, and this
    module's postponed annotations are strings.)
    """
    keys = [state.param_names[id(p)] for p in bucket.parameters()]
    part = (keys, list(bucket.gradients()), bucket.buffer())
    if state.merger is None:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(_reduce_parts(state, [part])[0])
        return future
    return state.merger.add(part, _nbytes(part[2]), bucket.is_last())


def _reduce_parts(state: CompressionHookState, parts: list) -> list[torch.Tensor]:
    """Average one or more (merged) buckets; one flat result per bucket, in its buffer's dtype."""
    keys = [k for part in parts for k in part[0]]
    grads = [g for part in parts for g in part[1]]
    buffers = [part[2] for part in parts]
    compressor = state.compressor
    flat = buffers[0] if len(buffers) == 1 else torch.cat([b.reshape(-1) for b in buffers])
    if compressor.summable and compressor.elementwise and not compressor.error_feedback:
        # A cast with no state: no residual to protect from a non-finite step, nothing per gradient.
        return list(_summable_bucket(state, grads, flat).split([b.numel() for b in buffers]))
    guard = KeepStateIfNonFinite(compressor, _all_keys(state, keys, flat), flat)
    if state.two_phase:
        merged = _two_phase(state, keys, flat)
    elif compressor.name == "powersgd" and hasattr(compressor, "matrix_shape"):
        merged = _powersgd(state, keys, grads, flat)
    elif compressor.summable:
        merged = torch.cat([a.reshape(-1).to(flat.dtype) for a in _summable(state, keys, grads)])
    else:
        merged = _gathered(state, keys, grads, out=flat)
    guard.restore()  # (a no-op on a finite step) the collectives ran as usual: every rank stays in step
    return list(merged.to(flat.dtype).split([b.numel() for b in buffers]))


# Kept importable from here, where the Trainer, reduce_scatter.py and the tests import them.
__all__ = [
    "CompressionHookState",
    "DenseHookState",
    "KeepStateIfNonFinite",
    "all_finite",
    "compressed_allreduce_hook",
    "dense_allreduce_hook",
]
