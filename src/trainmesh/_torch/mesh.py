"""Front-end meshes and layouts -> torch ``DeviceMesh`` and DTensor placements."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import Replicate, Shard

from trainmesh import runtime
from trainmesh.distribution.layout import TensorLayout
from trainmesh.distribution.mesh import DeviceMesh

_torch_meshes: dict[tuple, TorchDeviceMesh] = {}


def validate_mesh_against_world(mesh: DeviceMesh) -> None:
    """The mesh must name every process of the running job exactly once (checked locally, no collective)."""
    world = runtime.world_size()
    if mesh.size > world:
        raise ValueError(
            f"The mesh {mesh.shape} needs {mesh.size} processes but the job has {world}. "
            f"Launch with `trainmesh run -n {mesh.size}` or shrink the mesh. Received: mesh={mesh!r}"
        )
    ranks = sorted(int(r) for r in mesh.ranks().ravel())
    if ranks != list(range(world)):
        raise ValueError(
            f"The mesh's devices must be the job's {world} devices (0..{world - 1}), one per process. "
            f"Received: devices={mesh.devices.ravel().tolist()}"
        )


def to_torch_mesh(mesh: DeviceMesh) -> TorchDeviceMesh:
    """Build (once per mesh) the torch DeviceMesh with the same shape, ranks and axis names."""
    key = (mesh.shape, tuple(mesh.axis_names), tuple(mesh.ranks().ravel().tolist()))
    cached = _torch_meshes.get(key)
    if cached is not None:
        return cached
    runtime.initialize()
    validate_mesh_against_world(mesh)
    torch_mesh = TorchDeviceMesh(
        runtime.torch_device_type(),
        torch.as_tensor(mesh.ranks(), dtype=torch.int64),
        mesh_dim_names=tuple(mesh.axis_names),
    )
    _torch_meshes[key] = torch_mesh
    return torch_mesh


def forget_torch_meshes() -> None:
    """Drop cached meshes (their process groups die with the default group on shutdown)."""
    _torch_meshes.clear()


runtime.process_group.on_shutdown(forget_torch_meshes)


def to_placements(layout: TensorLayout, mesh: DeviceMesh) -> list:
    """One placement per mesh axis: ``Shard(dim)`` where the layout names the axis, else ``Replicate()``."""
    placements: list = [Replicate() for _ in mesh.axis_names]
    for dim, axis in enumerate(layout.axes):
        if axis is not None:
            placements[mesh.axis_index(axis)] = Shard(dim)
    return placements
