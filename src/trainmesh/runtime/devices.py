"""Device names as Keras writes them: ``"cpu:0" .. "cpu:N-1"`` (one per process) or ``"gpu:k"``.

torch runs one process per accelerator (SPMD), so a global device list has one entry per
process: the k-th process drives device ``k`` of the job.
"""

from __future__ import annotations

import torch

from .process_group import local_rank, world_size

_KNOWN_TYPES = ("cpu", "gpu", "cuda")


def accelerator_type() -> str:
    return "gpu" if torch.cuda.is_available() else "cpu"


def list_devices(device_type: str | None = None) -> list[str]:
    """Global device names of the job, one per process (Keras ``list_devices``).

    >>> list_devices("cpu")   # on one process
    ['cpu:0']
    """
    if device_type is not None:
        device_type = device_type.lower()
        if device_type not in _KNOWN_TYPES:
            raise ValueError(
                f"device_type must be one of {_KNOWN_TYPES} or None. Received: device_type={device_type!r}"
            )
        if device_type == "cuda":
            device_type = "gpu"
    kind = device_type or accelerator_type()
    if kind == "gpu" and not torch.cuda.is_available():
        return []
    return [f"{kind}:{i}" for i in range(world_size())]


def local_torch_device() -> torch.device:
    """The torch device this process computes on."""
    if torch.cuda.is_available() and torch.cuda.device_count():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def torch_device_type() -> str:
    """``"cuda"`` or ``"cpu"``: the device type torch's DeviceMesh is built on."""
    return local_torch_device().type


def to_local_device(batch, device: torch.device | None = None):
    """``batch`` (tensors, possibly nested in tuples, lists, dicts) on this process's device
    (``device``, when the caller looked it up once for many batches).

    The Trainer's batches come from host memory (arrays, datasets, DataLoaders); on a GPU the
    model's parameters are on the device, so every batch must follow them. On CPU: the identity."""
    device = device or local_torch_device()
    if device.type == "cpu":
        return batch
    from trainmesh.data.prefetch import map_tensors

    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)
