"""A DDP communication hook that averages gradients through a ``trainmesh.compression`` compressor.

Per bucket, every gradient is compressed under its parameter's name (so error-feedback
residuals follow the parameter, not DDP's bucket layout, which DDP rebuilds after the first
step and which differs between runs), then, by kind of compressor:

* summable (fp16, bf16): the compressed tensors of the bucket are flattened and all-reduced
  (SUM; optionally hierarchically), decompressed and divided by N. As torch's
  ``fp16_compress_hook``, gradients are divided by N *before* the cast, so a half-precision sum
  of N gradients cannot overflow where their mean would not.
* PowerSGD: the exact distributed algorithm (Vogels et al. 2019, as torch's ``powerSGD_hook``):
  all-reduce ``P = M Q``, orthogonalize, all-reduce ``Q = M^T P``; residual ``M - P Q^T``. The
  compressor holds the residuals and warm-start ``Q`` by parameter name, so they checkpoint.
* anything else (int8, top-k, a user's compressor): the bucket's payload is packed into one
  byte buffer and all-gathered; each rank decompresses every rank's payload and averages.
  The payload layout must depend only on the gradient shapes (true of int8's chunked scales
  and top-k's fixed k); it is checked once per bucket layout, before decompressing garbage.

A non-finite gradient (an fp16 overflow, a NaN loss the Trainer then skips) would poison the
error-feedback state for good; such a step leaves the compressor's state as it was before it
(:class:`KeepStateIfNonFinite`), as if it had not happened, which is what the skipped step is.

Collectives run synchronously inside the hook (the returned future is already complete):
simpler than chaining futures, and on gloo there is no overlap to lose to speak of.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from trainmesh.compression.base import Compressed, Compressor

from .accounting import ByteCounter

_ALIGN = 8  # byte offsets of packed tensors, so a uint8 slice can be viewed as any dtype


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CompressionHookState:
    """What :func:`compressed_allreduce_hook` needs: the compressor, group, names and counter.

    ``all_reduce`` sums a tensor in place over the group (default ``dist.all_reduce``; the
    Trainer passes hierarchical all-reduce across nodes); used for summable compressors and
    PowerSGD. All-gather always runs on ``process_group``.
    """

    def __init__(self, compressor: Compressor, process_group: Any, param_names: dict[int, str], *,
                 counter: ByteCounter | None = None,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a trainmesh Compressor. Received: {type(compressor).__name__}")
        self.compressor = compressor
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.param_names = param_names
        self.counter = counter if counter is not None else ByteCounter()
        self.all_reduce = all_reduce or (lambda tensor: dist.all_reduce(tensor, group=process_group))
        self._checked_layouts: set[tuple[str, ...]] = set()

    @classmethod
    def for_model(cls, ddp_model: torch.nn.parallel.DistributedDataParallel, compressor: Compressor,
                  **kwargs: Any) -> "CompressionHookState":
        names = {id(p): name for name, p in ddp_model.module.named_parameters()}
        return cls(compressor, ddp_model.process_group, names, **kwargs)


class KeepStateIfNonFinite:
    """Snapshot ``keys``' compressor state when ``tensor`` is not finite; ``restore`` puts it back.

    Compressors replace their per-key tensors on every compress (never update them in place),
    so keeping the old references is the whole snapshot.
    """

    FIELDS = ("residuals", "q_memory", "momentum_buffers", "steps")

    def __init__(self, compressor: Compressor, keys: list[str], tensor: torch.Tensor) -> None:
        self.compressor = compressor
        self.finite = bool(torch.isfinite(tensor).all())
        self.saved = {} if self.finite else {
            field: {k: getattr(compressor, field).get(k) for k in keys}
            for field in self.FIELDS if isinstance(getattr(compressor, field, None), dict)}

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
    grads = bucket.gradients()
    keys = [state.param_names[id(p)] for p in bucket.parameters()]
    compressor = state.compressor
    buffer = bucket.buffer()
    guard = KeepStateIfNonFinite(compressor, keys, buffer)
    if compressor.name == "powersgd" and hasattr(compressor, "matrix_shape"):
        averaged = _powersgd(state, keys, grads)
    elif compressor.summable:
        averaged = _summable(state, keys, grads)
    else:
        averaged = _gathered(state, keys, grads)
    guard.restore()  # (a no-op on a finite step) the collectives ran as usual: every rank stays in step
    out = torch.cat([a.reshape(-1).to(buffer.dtype) for a in averaged])
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(out)
    return future


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
    state.counter.add(sent=sum(p.nbytes() for p in payloads), dense=sum(_nbytes(g) for g in grads))
    return out


# --- everything else: all-gather each rank's payload ------------------------------------------
def _pack(payloads: list[Compressed]) -> tuple[torch.Tensor, list[tuple[int, str, torch.dtype, torch.Size, int]]]:
    """All tensors of ``payloads`` as one byte buffer, and where each lies in it."""
    layout, raws, offset = [], [], 0
    for index, payload in enumerate(payloads):
        for name, tensor in payload.tensors.items():
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            layout.append((index, name, tensor.dtype, tensor.shape, offset))
            raws.append((offset, raw))
            offset += -(-raw.numel() // _ALIGN) * _ALIGN
    device = raws[0][1].device if raws else torch.device("cpu")
    buffer = torch.zeros(offset, dtype=torch.uint8, device=device)
    for start, raw in raws:
        buffer[start : start + raw.numel()] = raw
    return buffer, layout


def _unpack(buffer: torch.Tensor, layout, payloads: list[Compressed]) -> list[Compressed]:
    tensors: list[dict[str, torch.Tensor]] = [{} for _ in payloads]
    for index, name, dtype, shape, start in layout:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        tensors[index][name] = buffer[start : start + size].view(dtype).reshape(shape)
    return [Compressed(t, p.meta) for t, p in zip(tensors, payloads)]


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
            "depends only on the gradient shapes (e.g. a fixed k for top-k).")
    state._checked_layouts.add(signature)


def _gathered(state: CompressionHookState, keys: list[str], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    compressor = state.compressor
    payloads = [compressor.compress(g, key=k) for k, g in zip(keys, grads)]
    packed, layout = _pack(payloads)
    _check_same_layout(state, keys, packed.numel())
    gathered = [torch.empty_like(packed) for _ in range(state.world_size)]
    dist.all_gather(gathered, packed, group=state.process_group)
    totals = [torch.zeros(g.shape, dtype=torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else g.dtype,
                          device=g.device) for g in grads]
    for buffer in gathered:
        for total, payload in zip(totals, _unpack(buffer, layout, payloads)):
            total += compressor.decompress(payload).to(total.dtype)
    state.counter.add(sent=sum(p.nbytes() for p in payloads), dense=sum(_nbytes(g) for g in grads))
    return [(t / state.world_size).to(g.dtype) for t, g in zip(totals, grads)]


# --- PowerSGD: two all-reduces (P, then Q) per bucket -----------------------------------------
def _powersgd(state: CompressionHookState, keys: list[str], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    psgd, n = state.compressor, state.world_size
    matrices, dense_parts, sent = {}, [], 0
    for index, (key, grad) in enumerate(zip(keys, grads)):
        shape = psgd.matrix_shape(grad.shape)
        work = grad.detach().to(torch.promote_types(grad.dtype, torch.float32))
        if shape is None:  # vectors and small matrices: sent as they are, as torch does
            dense_parts.append((index, work))
            continue
        rows, cols = shape
        matrix = work.reshape(rows, cols)
        if psgd.error_feedback and key in psgd.residuals:
            matrix = matrix + psgd.residuals[key].to(matrix).reshape(rows, cols)
        rank = min(psgd.rank, rows, cols)
        q = psgd.q_memory.get(key) if psgd.warm_start else None
        if q is None or tuple(q.shape) != (cols, rank):
            q = psgd._initial_q(key, cols, rank, matrix.dtype, matrix.device)
        matrices[index] = (key, matrix, q.to(matrix))
    # 1st all-reduce: every P, and the uncompressed tensors.
    ps = {i: m @ q for i, (_, m, q) in matrices.items()}
    first = [ps[i].reshape(-1) for i in ps] + [t.reshape(-1) for _, t in dense_parts]
    flat = torch.cat(first) if first else torch.zeros(0)
    if first:
        state.all_reduce(flat)
    sent += _nbytes(flat)
    pieces = iter(flat.split([t.numel() for t in first]))
    for i in ps:
        ps[i] = torch.linalg.qr(next(pieces).view(ps[i].shape)).Q  # the same orthonormal P everywhere
    averaged: dict[int, torch.Tensor] = {i: (next(pieces).view(t.shape) / n) for i, t in dense_parts}
    # 2nd all-reduce: every Q = M^T P.
    qs = {i: matrices[i][1].T @ ps[i] for i in ps}
    if qs:
        flat_q = torch.cat([q.reshape(-1) for q in qs.values()])
        state.all_reduce(flat_q)
        sent += _nbytes(flat_q)
        for i, q in zip(qs, flat_q.split([q.numel() for q in qs.values()])):
            key, matrix, _ = matrices[i]
            q = q.view(qs[i].shape) / n
            approx = ps[i] @ q.T
            if psgd.warm_start:
                psgd.q_memory[key] = q.clone()
            if psgd.error_feedback:  # torch's rule: local corrected matrix minus the shared approximation
                psgd.residuals[key] = (matrix - approx).reshape(grads[i].shape)
            averaged[i] = approx
    state.counter.add(sent=sent, dense=sum(_nbytes(g) for g in grads))
    return [averaged[i].reshape(g.shape).to(g.dtype) for i, g in enumerate(grads)]
