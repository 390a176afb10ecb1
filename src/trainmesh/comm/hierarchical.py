"""Hierarchical all-reduce for multi-node jobs: inside a node first, then across nodes.

Groups come from a 2-axis mesh ``("node", "local")``: the ``"local"`` axis groups the processes
of one node (fast links: NVLink, shared memory), the ``"node"`` axis groups the processes of
equal local rank across nodes (the network). :func:`node_groups` builds them from a layout,
:func:`groups_from_mesh` from a torch or trainmesh ``DeviceMesh``.

Algorithm, and why: reduce-scatter inside the node, all-reduce each 1/L shard across nodes
(L = processes per node), all-gather inside the node. The alternative (reduce to a leader,
all-reduce between leaders, broadcast from the leader) sends the whole tensor over one NIC per
node while the other L-1 processes' network links sit idle, and funnels the in-node traffic
through the leader. With reduce-scatter every process sends only n/L over the network, all L
links (multi-rail nodes have one NIC per GPU) work at once, and in-node traffic is the
bandwidth-optimal 2(L-1)/L * n per process. Same result, up to floating-point summation order.
"""

# No `from __future__ import annotations` in this module: DDP's register_comm_hook checks the
# hook's return annotation against the real torch.futures.Future[torch.Tensor] object.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainmesh._torch.flat_collectives import all_gather_flat, reduce_scatter_flat

NODE_AXIS, LOCAL_AXIS = "node", "local"
_OPS = {dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT}


def _job_timeout():
    """The default group's collective timeout, for the groups made here (None: torch's default).

    ``new_group()`` without a timeout gets torch's 30-minute default, not the job's: a host lost
    mid-step would then hang the inter-node all-reduce for half an hour instead of failing and
    letting the launcher restart the job. (Private in torch, hence the fallback.)
    """
    try:
        return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001
        return None


def node_groups(nnodes: int, nproc_per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(intra_group, inter_group)`` of this process, rank = node * nproc_per_node + local rank.

    Every process of the job must call it (it creates process groups, a collective step).
    """
    for name, value in (("nnodes", nnodes), ("nproc_per_node", nproc_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")
    if not dist.is_initialized():
        raise RuntimeError("node_groups needs torch.distributed initialized (trainmesh.runtime.initialize()).")
    world = dist.get_world_size()
    if nnodes * nproc_per_node != world:
        raise ValueError(
            f"nnodes * nproc_per_node must equal the world size {world}. "
            f"Received: nnodes={nnodes}, nproc_per_node={nproc_per_node}"
        )
    rank = dist.get_rank()
    intra = inter = None
    timeout = _job_timeout()
    # Every process creates every group, in the same order, as new_group requires.
    for node in range(nnodes):
        group = dist.new_group([node * nproc_per_node + local for local in range(nproc_per_node)], timeout=timeout)
        if node == rank // nproc_per_node:
            intra = group
    for local in range(nproc_per_node):
        group = dist.new_group([node * nproc_per_node + local for node in range(nnodes)], timeout=timeout)
        if local == rank % nproc_per_node:
            inter = group
    return intra, inter


def groups_from_mesh(mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(intra_group, inter_group)`` from a torch or trainmesh ``DeviceMesh`` with axes ``("node", "local")``."""
    if not hasattr(mesh, "get_group"):
        names = getattr(mesh, "axis_names", None)
        if names is None:
            raise TypeError(f"groups_from_mesh expects a DeviceMesh. Received: {type(mesh).__name__}")
        from trainmesh._torch.mesh import to_torch_mesh  # the trainmesh front-end mesh -> torch's

        mesh = to_torch_mesh(mesh)
    names = tuple(mesh.mesh_dim_names or ())
    if NODE_AXIS not in names or LOCAL_AXIS not in names:
        raise ValueError(
            f"The mesh needs axes named {NODE_AXIS!r} and {LOCAL_AXIS!r}. Received: mesh_dim_names={names}"
        )
    return mesh.get_group(LOCAL_AXIS), mesh.get_group(NODE_AXIS)


def _check(tensor, intra_group, inter_group, op) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"hierarchical_all_reduce_ expects a torch.Tensor. Received: {type(tensor).__name__}")
    if op not in _OPS:
        raise ValueError(f"op must be one of SUM, AVG, MIN, MAX, PRODUCT. Received: op={op!r}")
    for name, group in (("intra_group", intra_group), ("inter_group", inter_group)):
        if group is None or dist.get_rank(group) < 0:
            raise ValueError(f"This process (rank {dist.get_rank()}) is not a member of {name}. Received: {group!r}")


def hierarchical_all_reduce_(tensor: torch.Tensor, *, intra_group, inter_group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place over intra x inter groups; returns ``tensor``.

    Equals ``dist.all_reduce`` over the union of the groups (up to summation order). Any size
    works: the flat tensor is zero-padded to a multiple of the node size for the scatter.
    """
    _check(tensor, intra_group, inter_group, op)
    local_size = dist.get_world_size(intra_group)
    average = op == dist.ReduceOp.AVG
    # gloo has no AVG: sum, then divide by the number of processes.
    reduce_op = dist.ReduceOp.SUM if average else op
    numel = tensor.numel()
    if numel == 0:
        return tensor
    shard_len = -(-numel // local_size)
    # Work in the tensor's own memory when it is contiguous and splits evenly (the usual DDP
    # bucket); otherwise in a zero-padded copy. The padding is never read back, so zeros serve
    # every op (MIN/MAX/PRODUCT included).
    in_place = tensor.is_contiguous() and not tensor.requires_grad and shard_len * local_size == numel
    if in_place:
        flat = tensor.view(-1)
    else:
        flat = torch.zeros(shard_len * local_size, dtype=tensor.dtype, device=tensor.device)
        flat[:numel].copy_(tensor.reshape(-1))
    if local_size == 1:
        dist.all_reduce(flat, op=reduce_op, group=inter_group)
    else:
        shard = torch.empty(shard_len, dtype=tensor.dtype, device=tensor.device)
        reduce_scatter_flat(shard, flat, op=reduce_op, group=intra_group)
        dist.all_reduce(shard, op=reduce_op, group=inter_group)
        all_gather_flat(flat, shard, group=intra_group)
    with torch.no_grad():
        if average:  # (true division, then cast back: integer tensors truncate as they did)
            flat.copy_(flat / (local_size * dist.get_world_size(inter_group)))
        if not in_place:
            tensor.copy_(flat[:numel].view(tensor.shape))
    return tensor


@dataclass
class HierarchicalState:
    """State of :func:`hierarchical_hook`: the two groups; gradients are averaged over both."""

    intra_group: dist.ProcessGroup
    inter_group: dist.ProcessGroup

    @classmethod
    def from_mesh(cls, mesh) -> "HierarchicalState":
        return cls(*groups_from_mesh(mesh))

    @classmethod
    def from_layout(cls, nnodes: int, nproc_per_node: int) -> "HierarchicalState":
        return cls(*node_groups(nnodes, nproc_per_node))

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.intra_group) * dist.get_world_size(self.inter_group)


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``ddp.register_comm_hook(HierarchicalState.from_mesh(mesh), hierarchical_hook)``.

    Averages the bucket like DDP's default all-reduce. The three collectives run synchronously
    in the hook: chaining them in future callbacks would run blocking collectives on gloo's
    worker threads, where concurrent buckets can deadlock or issue collectives in a different
    order on different ranks. The cost is less overlap of communication with backward.
    """
    buffer = bucket.buffer()
    hierarchical_all_reduce_(buffer, intra_group=state.intra_group, inter_group=state.inter_group)
    buffer.div_(state.world_size)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
