"""Collectives of one step, per mesh axis: counted where they happen, at the dispatcher.

``CollectiveCounter`` is a ``TorchDispatchMode`` that sees every c10d op (the eager
``c10d.*_`` ops FSDP2 and DDP issue, and the functional ``_c10d_functional.*`` ops DTensor and
tensor parallelism issue), reads the tensor sizes and the process group, and files the call
under the mesh axis that group belongs to. The same counter runs on the fake process group
(the plan) and on a real gloo group (``benchmarks/plan_accuracy.py``), so planned and counted
bytes come from one definition.

``bytes`` of a call is the size of the collective's *full* buffer on one rank: the all-gather
output, the reduce-scatter input, the all-reduce tensor, the broadcast tensor. What crosses a
link is derived from it by ``wire_bytes`` (ring algorithms, as NCCL and gloo use for large
messages): all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, broadcast and
point-to-point the whole buffer.

>>> wire_bytes("all_reduce", 1000, 4)
1500.0
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainmesh.comm.allreduce_scatter import carrying_reduce_scatter

# op name (without namespace/overload) -> (kind, index of the "full buffer" argument or "out"/"in" rule)
_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "send_recv",  # point-to-point counted once, at the sender (a recv is its partner's send)
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
}
_WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


# gloo (torch 2.14's ProcessGroupGloo on CPU) differs from the ring table in one place, seen in the
# bytes a process writes to its sockets: its reduce-scatter all-reduces the whole input, then keeps its
# piece (2(n-1)/n of the full buffer, twice the ring's). benchmarks/plan_accuracy.py checks this table
# against the bytes each real process wrote.
_WIRE_GLOO = {**_WIRE, "reduce_scatter": _WIRE["all_reduce"]}


def wire_bytes(kind: str, nbytes: float, group_size: int, backend: str = "nccl") -> float:
    """Bytes one rank sends over its link for a collective whose full buffer is ``nbytes``, with the
    algorithms of ``backend`` (``"nccl"``: rings; ``"gloo"``: rings, reduce-scatter as an all-reduce)."""
    if group_size <= 1:
        return 0.0
    table = _WIRE_GLOO if backend == "gloo" else _WIRE
    return table.get(kind, lambda n: 1.0)(group_size) * nbytes


@dataclass
class AxisTraffic:
    """Calls and full-buffer bytes of one collective kind on one axis."""

    count: int = 0
    bytes: int = 0


@dataclass
class CollectiveLog:
    """``(axis, kind) -> AxisTraffic``; ``axis`` is a mesh axis name, a '+'-joined set of axes, or
    ``"world"``/``"other"``."""

    traffic: dict[tuple[str, str], AxisTraffic] = field(default_factory=lambda: defaultdict(AxisTraffic))
    group_sizes: dict[str, int] = field(default_factory=dict)

    def add(self, axis: str, kind: str, nbytes: int, count: int = 1) -> None:
        entry = self.traffic[(axis, kind)]
        entry.count += count
        entry.bytes += int(nbytes)

    def scaled(self, factor: float) -> "CollectiveLog":
        out = CollectiveLog(group_sizes=dict(self.group_sizes))
        for (axis, kind), t in self.traffic.items():
            out.add(axis, kind, round(t.bytes * factor), round(t.count * factor))
        return out

    def merged(self, other: "CollectiveLog") -> "CollectiveLog":
        out = self.scaled(1)
        out.group_sizes.update(other.group_sizes)
        for (axis, kind), t in other.traffic.items():
            out.add(axis, kind, t.bytes, t.count)
        return out

    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.traffic.values())

    def rows(self) -> list[dict]:
        return [
            {
                "axis": axis,
                "kind": kind,
                "count": t.count,
                "bytes": t.bytes,
                "group_size": self.group_sizes.get(axis, 0),
            }
            for (axis, kind), t in sorted(self.traffic.items())
        ]


def group_axes(torch_mesh) -> dict[str, str]:
    """process group name -> axis name for every axis (and the flattened whole) of ``torch_mesh``."""
    names = torch_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(torch_mesh.ndim))
    out = {}
    for i, name in enumerate(names):
        group = torch_mesh.get_group(i)
        out[group.group_name] = name
    return out


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d calls made while active, filed per axis by their process group's name.

    ``axis_of``: group name -> axis name; groups not in it are filed as ``"world"`` when they
    span every rank, else ``"other"``.
    """

    def __init__(self, axis_of: dict[str, str], log: CollectiveLog | None = None):
        super().__init__()
        self.axis_of = dict(axis_of)
        self.log = log if log is not None else CollectiveLog()

    def _axis(self, args) -> tuple[str, int]:
        import torch.distributed as dist

        for arg in args:
            group = None
            if isinstance(arg, str) and arg in self.axis_of:
                name = arg
            elif type(arg).__name__ == "ScriptObject" and "ProcessGroup" in str(getattr(arg, "_type", lambda: "")()):
                group = dist.ProcessGroup.unbox(arg)
                name = group.group_name
            elif isinstance(arg, str):
                try:
                    group = torch._C._distributed_c10d._resolve_process_group(arg)
                except (RuntimeError, AttributeError, ValueError):
                    continue
                name = arg
            else:
                continue
            if group is None:
                group = torch._C._distributed_c10d._resolve_process_group(name)
            size = group.size()
            axis = self.axis_of.get(name) or ("world" if size == dist.get_world_size() else "other")
            self.log.group_sizes[axis] = size
            return axis, size
        return "other", 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            kind = _KINDS.get(func._opname)
            if kind == "all_reduce" and carrying_reduce_scatter():
                kind = "reduce_scatter"  # FSDP2's, carried by an all-reduce on gloo (comm/allreduce_scatter.py)
            if kind is not None:
                self.log.add(*self._record(kind, args, out), 1)
        return out

    def _record(self, kind: str, args, out) -> tuple[str, str, int]:
        axis, size = self._axis(tree_leaves(args))
        tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        sizes = [t.numel() * t.element_size() for t in tensors]
        if kind in ("all_gather", "reduce_scatter"):
            # The full buffer is the largest tensor involved (the gathered output, the scattered input).
            full = max(sizes + [t.numel() * t.element_size() for t in outs], default=0)
        else:  # all-reduce / broadcast / point-to-point: every tensor passed (coalesced lists included)
            full = sum(sizes)
        return axis, kind, full
