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

from trainmesh.compression.base import Compressed, Compressor

from .accounting import ByteCounter, ring_wire_bytes  # noqa: F401 (ring_wire_bytes: imported from here too)
from .bucket_worker import BucketMerger, BucketWorker
from .packing import pack as _pack, unpack as _unpack  # noqa: F401 (reduce_scatter imports them from here)
from .powersgd_exchange import powersgd_across_hosts, powersgd_all_reduce
from .two_phase import exchange_keys, hierarchical_compressed_all_reduce, two_phase_all_reduce


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


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


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite: ``torch.isfinite(tensor).all()``, faster.

    Min and max propagate NaN and are infinite exactly when an element is, and ``aminmax`` runs
    at memory speed, where ``isfinite`` on CPU takes ~10 ns per element (measured: 14-18 ms for a
    6 MB bucket, more than the int8 quantisation of it; the hook checks every bucket every step).
    """
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


class KeepStateIfNonFinite:
    """Snapshot ``keys``' compressor state when ``tensor`` is not finite; ``restore`` puts it back.

    Compressors replace their per-key tensors on every compress (never update them in place),
    so keeping the old references is the whole snapshot.
    """

    FIELDS = ("residuals", "q_memory", "momentum_buffers", "steps")

    def __init__(self, compressor: Compressor, keys: list[str], tensor: torch.Tensor) -> None:
        self.compressor = compressor
        self.finite = all_finite(tensor)
        self.saved = (
            {}
            if self.finite
            else {
                field: {k: getattr(compressor, field).get(k) for k in keys}
                for field in self.FIELDS
                if isinstance(getattr(compressor, field, None), dict)
            }
        )

    def restore(self) -> None:
        for field, values in self.saved.items():
            table = getattr(self.compressor, field)
            for key, value in values.items():
                if value is None:
                    table.pop(key, None)
                else:
                    table[key] = value


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


# --- no compression: the same overlap and bucket merging for exact fp32 all-reduce ------------
class DenseHookState:
    """State of :func:`dense_allreduce_hook`: ``all_reduce`` (flat or hierarchical) sums in place.

    Used for hierarchical all-reduce without compression, and by ``communication="auto"`` when
    it merges buckets; the plain flat case is left to DDP's own (already overlapped) all-reduce.
    """

    def __init__(
        self,
        world_size: int,
        all_reduce: Callable[[torch.Tensor], None],
        *,
        overlap: bool = True,
        bucket_bytes: int = 0,
    ) -> None:
        self.world_size, self.all_reduce = world_size, all_reduce
        self.worker = BucketWorker() if overlap else None
        self.merger = BucketMerger(self.worker, self._reduce, bucket_bytes) if self.worker is not None else None

    def _reduce(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = buffers[0] if len(buffers) == 1 else torch.cat([b.reshape(-1) for b in buffers])
        self.all_reduce(flat)
        flat.div_(self.world_size)
        return list(flat.split([b.numel() for b in buffers])) if len(buffers) > 1 else [flat]


def dense_allreduce_hook(state: DenseHookState, bucket):  # -> Future[Tensor]
    """``ddp_model.register_comm_hook(DenseHookState(n, all_reduce), dense_allreduce_hook)``."""
    buffer = bucket.buffer()
    if state.merger is None:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(state._reduce([buffer])[0])
        return future
    return state.merger.add(buffer, _nbytes(buffer), bucket.is_last())
