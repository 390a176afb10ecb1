"""PowerSGD's exchange in a DDP hook: over every process, or across hosts only (fp32 inside a host).

The distributed algorithm (Vogels et al. 2019, as torch's ``powerSGD_hook``), per bucket:
all-reduce ``P = M Q`` (with the tensors that pass through uncompressed in the same message),
orthogonalize ``P``, all-reduce ``Q = M^T P``; the average is ``P Q^T / N`` and error feedback
keeps ``M - P Q^T / N`` per process. Residuals and the warm-start ``Q`` live in the compressor
under the parameter's name, so they follow the parameter into checkpoints.

Both all-reduces sum ``M_i Q`` and ``M_i^T P`` over processes, which are linear in ``M_i``: they
equal the same products of ``sum_i M_i``. So across hosts (:func:`powersgd_across_hosts`) each
host first sums its processes' gradients in fp32 into its local rank 0 (one reduce over
loopback), only those leaders run PowerSGD with each other (the two small all-reduces cross the
network between H processes instead of all N), and each leader broadcasts ``P``, ``Q`` and the
uncompressed tensors inside its host, where every process rebuilds ``P Q^T``. Why: with many
processes per host the factors are a few KB, so each all-reduce costs its latency, not its
bytes; a hierarchical all-reduce of ``P`` is three collectives over all N processes (and every
process would run the power iteration), against one reduce, one broadcast and two all-reduces
between the leaders here. The result is the same up to summation order, and so is the error
feedback: the leader keeps ``M_h - P Q^T / H`` for its host's summed ``M_h``; the residuals sum
to the same total over a host's processes as in the flat algorithm (a process that still holds
a residual, from a checkpoint of a flat run, adds it to the gradient it hands over and drops it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .accounting import ring_wire_bytes


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class _Factor:
    index: int  # position of the gradient in the bucket
    key: str
    rows: int
    cols: int
    rank: int


def _factors(psgd, keys: list[str], grads: list[torch.Tensor]) -> tuple[list[_Factor], list[int]]:
    """Which gradients are compressed (as ``rows x cols``, rank r) and which pass through."""
    factors, dense = [], []
    for index, (key, grad) in enumerate(zip(keys, grads)):
        shape = psgd.matrix_shape(grad.shape)
        if shape is None:  # vectors and small matrices: sent as they are, as torch does
            dense.append(index)
        else:
            rows, cols = shape
            factors.append(_Factor(index, key, rows, cols, min(psgd.rank, rows, cols)))
    return factors, dense


def _warm_q(psgd, factor: _Factor, like: torch.Tensor) -> torch.Tensor:
    q = psgd.q_memory.get(factor.key) if psgd.warm_start else None
    if q is None or tuple(q.shape) != (factor.cols, factor.rank):
        q = psgd._initial_q(factor.key, factor.cols, factor.rank, like.dtype, like.device)
    return q.to(like)


# --- every process in the exchange ----------------------------------------------------------
def powersgd_all_reduce(state: Any, keys: list[str], grads: list[torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    """The bucket's average (flat) through ``state.all_reduce`` over every process.

    Returns ``(average, payload bytes, wire bytes this rank sent)``.
    """
    psgd, n = state.compressor, state.world_size
    factors, dense = _factors(psgd, keys, grads)
    work = [g.detach().to(torch.promote_types(g.dtype, torch.float32)) for g in grads]
    matrices, qs_in = [], []
    for f in factors:
        matrix = work[f.index].reshape(f.rows, f.cols)
        if psgd.error_feedback and f.key in psgd.residuals:
            matrix = matrix + psgd.residuals[f.key].to(matrix).reshape(f.rows, f.cols)
        matrices.append(matrix)
        qs_in.append(_warm_q(psgd, f, matrix))
    # 1st all-reduce: every P, and the uncompressed tensors.
    first = [(m @ q).reshape(-1) for m, q in zip(matrices, qs_in)] + [work[i].reshape(-1) for i in dense]
    flat = torch.cat(first) if first else torch.zeros(0)
    if first:
        state.all_reduce(flat)
    sent, wire = _nbytes(flat), state.allreduce_wire(_nbytes(flat))
    pieces = iter(flat.split([t.numel() for t in first]))
    ps = [torch.linalg.qr(next(pieces).view(f.rows, f.rank)).Q for f in factors]  # the same P everywhere
    averaged: dict[int, torch.Tensor] = {i: next(pieces) / n for i in dense}
    # 2nd all-reduce: every Q = M^T P.
    if factors:
        flat_q = torch.cat([(m.T @ p).reshape(-1) for m, p in zip(matrices, ps)])
        state.all_reduce(flat_q)
        sent += _nbytes(flat_q)
        wire += state.allreduce_wire(_nbytes(flat_q))
        for f, matrix, p, q in zip(factors, matrices, ps, flat_q.split([f.cols * f.rank for f in factors])):
            q = q.view(f.cols, f.rank) / n
            approx = p @ q.T
            if psgd.warm_start:
                psgd.q_memory[f.key] = q.clone()
            if psgd.error_feedback:  # torch's rule: local corrected matrix minus the shared approximation
                psgd.residuals[f.key] = (matrix - approx).reshape(grads[f.index].shape)
            averaged[f.index] = approx
    out = torch.cat([averaged[i].reshape(-1) for i in range(len(grads))]) if grads else torch.zeros(0)
    return out, sent, wire


# --- across hosts only: fp32 sum inside each host, PowerSGD between the hosts' leaders ------------
def _shared_layout(factors: list[_Factor], grads: list[torch.Tensor], dense: list[int]) -> tuple[int, int]:
    """Sizes of the two segments of the leader's message: ``[P's | uncompressed]`` and ``[Q's]``."""
    first = sum(f.rows * f.rank for f in factors) + sum(grads[i].numel() for i in dense)
    return first, sum(f.cols * f.rank for f in factors)


def powersgd_across_hosts(
    state: Any, keys: list[str], grads: list[torch.Tensor], flat: torch.Tensor
) -> tuple[torch.Tensor, int, int]:
    """The bucket's average (flat), PowerSGD between hosts only; ``flat`` is the bucket's gradients
    concatenated in ``grads`` order (DDP's bucket buffer; it is used as scratch).

    Returns ``(average, payload bytes, wire bytes this rank sent)``: the leader sends the factors
    across hosts; the other processes send nothing across hosts (their fp32 gradients stay on the host).
    The leaders (rank 0 of every ``intra_group``) must share one ``inter_group``, as ``node_groups``
    and ``topology.host_groups`` build them (local index 0 on every host).
    """
    psgd, intra = state.compressor, state.intra_group
    local, leader = dist.get_world_size(intra), dist.get_rank(intra) == 0
    factors, dense = _factors(psgd, keys, grads)
    work = flat.detach().reshape(-1)
    work = work.to(torch.promote_types(work.dtype, torch.float32))  # (no copy for an fp32 bucket)
    pieces = work.split([g.numel() for g in grads])
    if psgd.error_feedback:
        for f in factors:  # a residual this process holds travels with its gradient to the leader
            residual = psgd.residuals.pop(f.key, None)
            if residual is not None:
                pieces[f.index].add_(residual.to(work).reshape(-1))
    if local > 1:
        dist.reduce(work, group_dst=0, group=intra)  # the host's sum on its leader; scratch elsewhere
    first_len, q_len = _shared_layout(factors, grads, dense)
    shared = torch.empty(first_len + q_len, dtype=work.dtype, device=work.device)
    sent = wire = 0
    if leader:
        wire = _leader_exchange(state, factors, dense, pieces, [g.shape for g in grads], shared, first_len, local)
        sent = _nbytes(shared)
    if local > 1:
        dist.broadcast(shared, group_src=0, group=intra)
    # Every process rebuilds the average from the leader's message, into the bucket's own memory.
    ps, qs = _split_factors(shared, factors, first_len)
    for f, p, q in zip(factors, ps, qs):
        torch.matmul(p, q.T, out=pieces[f.index].view(f.rows, f.cols))
    offset = sum(f.rows * f.rank for f in factors)
    for i in dense:
        pieces[i].copy_(shared[offset : offset + pieces[i].numel()])
        offset += pieces[i].numel()
    return work, sent, wire


def _split_factors(shared: torch.Tensor, factors: list[_Factor], first_len: int):
    """Views of each ``P`` (from the start) and each ``Q`` (from ``first_len``) in the leader's message."""
    ps, qs, p_at, q_at = [], [], 0, first_len
    for f in factors:
        ps.append(shared[p_at : p_at + f.rows * f.rank].view(f.rows, f.rank))
        qs.append(shared[q_at : q_at + f.cols * f.rank].view(f.cols, f.rank))
        p_at, q_at = p_at + f.rows * f.rank, q_at + f.cols * f.rank
    return ps, qs


def _leader_exchange(
    state: Any,
    factors: list[_Factor],
    dense: list[int],
    pieces,
    shapes: list[torch.Size],
    shared: torch.Tensor,
    first_len: int,
    local: int,
) -> int:
    """PowerSGD between the hosts' leaders on the host sums in ``pieces``; fills ``shared`` with
    ``[orthonormal P's | averaged uncompressed | averaged Q's]``; returns the wire bytes sent."""
    psgd, inter, n = state.compressor, state.inter_group, state.world_size
    hosts = dist.get_world_size(inter)
    matrices = [pieces[f.index].view(f.rows, f.cols) for f in factors]
    ps, qs = _split_factors(shared, factors, first_len)
    for f, matrix, p in zip(factors, matrices, ps):
        torch.matmul(matrix, _warm_q(psgd, f, matrix), out=p)
    offset = sum(f.rows * f.rank for f in factors)
    for i in dense:
        shared[offset : offset + pieces[i].numel()].copy_(pieces[i])
        offset += pieces[i].numel()
    head, tail = shared[:first_len], shared[first_len:]
    if first_len:
        dist.all_reduce(head, group=inter)  # every P and the uncompressed tensors: one message
    shared[sum(f.rows * f.rank for f in factors) : first_len].div_(n)
    for f, matrix, p, q in zip(factors, matrices, ps, qs):
        p.copy_(torch.linalg.qr(p).Q)  # the same orthonormal P on every leader
        torch.matmul(matrix.T, p, out=q)
    if factors:
        dist.all_reduce(tail, group=inter)
        tail.div_(n)
    for f, matrix, p, q in zip(factors, matrices, ps, qs):
        if psgd.warm_start:
            psgd.q_memory[f.key] = q.clone()
        if psgd.error_feedback:  # this host's sum minus its share (1/H) of the summed approximation
            psgd.residuals[f.key] = torch.addmm(matrix, p, q.T, alpha=-float(local)).view(shapes[f.index])
    return ring_wire_bytes(_nbytes(head), hosts) + ring_wire_bytes(_nbytes(tail), hosts)
