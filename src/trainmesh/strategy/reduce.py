"""Cross-replica reductions with TF's semantics: ``ReduceOp``, ``reduce`` and ``gather``.

With one replica per process, a "per-replica value" is simply this process's tensor; these
functions combine the values of all replicas with torch.distributed collectives and return
the same result on every process. They are not differentiable (TF's are used on losses and
metrics after the step, as here). Shapes must agree across replicas where TF requires it
(``reduce`` with ``axis=None``; every dim but ``axis`` otherwise); ``gather`` checks shapes
on every replica before moving data, so a mismatch is the same ValueError everywhere.
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import torch
import torch.distributed as dist


class ReduceOp(enum.Enum):
    """How per-replica values are combined (TF ``tf.distribute.ReduceOp``).

    >>> ReduceOp.from_value("mean") is ReduceOp.MEAN
    True
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_value(cls, op: "ReduceOp | str") -> "ReduceOp":
        if isinstance(op, cls):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        raise ValueError(
            f"reduce_op must be ReduceOp.SUM or ReduceOp.MEAN (or 'sum'/'mean'). Received: reduce_op={op!r}"
        )


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"Only tensors and numbers can be reduced across replicas. Received: value={value!r}"
        ) from None


def _floating(tensor: torch.Tensor) -> torch.Tensor:
    # A MEAN of integers is a fraction (torch.mean refuses integer input for the same reason).
    return tensor if tensor.is_floating_point() or tensor.is_complex() else tensor.to(torch.get_default_dtype())


def _check_axis(axis: int, tensor: torch.Tensor) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not -tensor.dim() <= axis < max(tensor.dim(), 1):
        raise ValueError(
            f"axis must be an int in [-{tensor.dim()}, {tensor.dim()}) for a value of shape {tuple(tensor.shape)}. "
            f"Received: axis={axis!r}"
        )
    if tensor.dim() == 0:
        raise ValueError(f"A scalar has no axis to reduce or gather along. Received: axis={axis}, shape=()")
    return axis % tensor.dim()


def _distributed(num_replicas: int) -> bool:
    return num_replicas > 1 and dist.is_available() and dist.is_initialized()


def reduce_across_replicas(reduce_op: ReduceOp | str, value: Any, axis: int | None, num_replicas: int) -> Any:
    """``strategy.reduce``: combine ``value`` (a tensor, number, or tuple/list/dict of them) over replicas.

    ``axis=None``: element-wise SUM (or MEAN) of the replicas' values, which must have equal
    shapes. With ``axis``: also reduce along ``axis``; MEAN divides by the *global* number of
    elements along it, so replicas holding different numbers of rows are weighted exactly.

    >>> reduce_across_replicas("mean", torch.tensor([[1.0, 2.0], [3.0, 4.0]]), axis=0, num_replicas=1)
    tensor([2., 3.])
    """
    op = ReduceOp.from_value(reduce_op)
    if isinstance(value, dict):
        return type(value)((k, reduce_across_replicas(op, v, axis, num_replicas)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return type(value)(reduce_across_replicas(op, v, axis, num_replicas) for v in value)
    tensor = _as_tensor(value)
    if axis is None:
        result = tensor.clone()  # all_reduce works in place; never overwrite the caller's tensor
        if _distributed(num_replicas):
            dist.all_reduce(result, op=dist.ReduceOp.SUM)
        return _floating(result) / num_replicas if op is ReduceOp.MEAN else result
    dim = _check_axis(axis, tensor)
    count = tensor.shape[dim]
    local_sum = tensor.sum(dim)
    if not _distributed(num_replicas):
        return _floating(local_sum) / count if op is ReduceOp.MEAN else local_sum
    # One collective for the sum and the element count: pack both in float64, where counts
    # are exact and fp32/bf16 sums lose nothing; cast back afterwards.
    packed = torch.cat(
        [
            local_sum.reshape(-1).to(torch.float64),
            torch.tensor([float(count)], dtype=torch.float64, device=local_sum.device),
        ]
    )
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    total = packed[:-1].reshape(local_sum.shape)
    if op is ReduceOp.MEAN:
        return (total / packed[-1]).to(_floating(local_sum).dtype)
    return total.to(local_sum.dtype)


def gather_across_replicas(value: Any, axis: int, replica_ranks: Sequence[int]) -> torch.Tensor:
    """``strategy.gather``: concatenate every replica's tensor along ``axis``, in replica order.

    Sizes along ``axis`` may differ between replicas (they are exchanged first); every other
    dim and the dtype must agree.

    >>> gather_across_replicas(torch.ones(2, 3), axis=1, replica_ranks=[0]).shape
    torch.Size([2, 3])
    """
    tensor = _as_tensor(value)
    dim = _check_axis(axis, tensor)
    if not _distributed(len(replica_ranks)):
        return tensor.clone()
    world = dist.get_world_size()
    meta: list = [None] * world
    dist.all_gather_object(meta, (tuple(tensor.shape), str(tensor.dtype)))
    others = {(shape[:dim] + shape[dim + 1 :], len(shape), dtype) for shape, dtype in meta}
    if len(others) != 1:
        raise ValueError(
            f"gather needs the same dtype and the same size in every dim but axis={axis} on every replica. "
            f"Received: (shape, dtype) per process={meta}"
        )
    # all_gather moves equal shapes only: pad every value to the longest, then cut each back.
    longest = max(shape[dim] for shape, _ in meta)
    padded_shape = list(tensor.shape)
    padded_shape[dim] = longest
    padded = tensor.new_zeros(padded_shape)
    padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    outputs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(outputs, padded)
    return torch.cat([outputs[r].narrow(dim, 0, meta[r][0][dim]) for r in replica_ranks], dim=dim)
