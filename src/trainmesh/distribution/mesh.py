"""``DeviceMesh``: a named n-d grid of devices (Keras 3 semantics), pure metadata.

A mesh of 8 logical devices can be built and queried in a single process; it becomes a
torch ``DeviceMesh`` only when a distribution is applied (see ``trainmesh._torch``), and
only then must it match the running job.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np


def _default_devices() -> list[str]:
    from trainmesh.runtime import list_devices  # late: keep the front end free of torch.distributed

    return list_devices()


def device_index(device: str) -> int:
    """``"cpu:3"`` -> 3: the global index (= process rank) of a device name."""
    match = re.fullmatch(r"[A-Za-z_]+:(\d+)", str(device))
    if match is None:
        raise ValueError(f"A device name must look like 'cpu:0' or 'gpu:3'. Received: device={device!r}")
    return int(match.group(1))


class DeviceMesh:
    """A cluster of devices arranged in a named grid.

    >>> mesh = DeviceMesh((2, 4), ["data", "model"], devices=[f"cpu:{i}" for i in range(8)])
    >>> mesh.shape, mesh.axis_names, mesh.devices.shape
    ((2, 4), ['data', 'model'], (2, 4))
    """

    def __init__(self, shape: Sequence[int], axis_names: Sequence[str], devices: Sequence[str] | None = None):
        if not shape:
            raise ValueError(f"Shape for DeviceMesh cannot be empty. Received: shape={shape!r}")
        if not axis_names:
            raise ValueError(f"Axis names for DeviceMesh cannot be empty. Received: axis_names={axis_names!r}")
        if isinstance(axis_names, str):
            raise TypeError(f"axis_names must be a list of names, not a string. Received: axis_names={axis_names!r}")
        shape = tuple(int(s) for s in shape)
        axis_names = [str(a) for a in axis_names]
        if len(shape) != len(axis_names):
            raise ValueError(
                f"Shape and axis_names cannot have different length. Received: shape={shape}, axis_names={axis_names}"
            )
        if any(s < 1 for s in shape):
            raise ValueError(f"Every mesh axis needs at least one device. Received: shape={shape}")
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"Axis names must be unique. Received: axis_names={axis_names}")
        if devices is None:
            devices = _default_devices()
        devices = np.asarray(devices, dtype=object)
        if math.prod(shape) != devices.size:
            raise ValueError(
                f"Shape and devices mismatch: a mesh of shape {shape} needs {math.prod(shape)} devices. "
                f"Received: shape={shape}, {devices.size} devices={devices.ravel().tolist()}"
            )
        flat = [str(d) for d in devices.ravel()]
        indices = [device_index(d) for d in flat]
        if len(set(indices)) != len(indices):
            # The index is the process rank: "cpu:0" and "gpu:0" would be the same process twice.
            raise ValueError(f"A device (process) may appear only once in a mesh. Received: devices={flat}")
        self._shape = shape
        self._axis_names = axis_names
        self._devices = np.asarray(flat, dtype=object).reshape(shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def axis_names(self) -> list[str]:
        return list(self._axis_names)

    @property
    def devices(self) -> np.ndarray:
        return self._devices

    @property
    def size(self) -> int:
        return int(self._devices.size)

    def axis_size(self, axis: str) -> int:
        return self._shape[self.axis_index(axis)]

    def axis_index(self, axis: str) -> int:
        if axis not in self._axis_names:
            raise ValueError(f"Axis {axis!r} is not in the mesh axes {self._axis_names}. Received: axis={axis!r}")
        return self._axis_names.index(axis)

    def ranks(self) -> np.ndarray:
        """The process rank behind every mesh position (the device indices), same shape as the mesh."""
        return np.vectorize(device_index, otypes=[int])(self._devices)

    def coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        """Where process ``rank`` sits in the mesh, or None when it is not part of it."""
        hits = np.argwhere(self.ranks() == rank)
        return tuple(int(i) for i in hits[0]) if len(hits) else None

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DeviceMesh)
            and self._shape == other._shape
            and self._axis_names == other._axis_names
            and (self._devices == other._devices).all()
        )

    def __hash__(self) -> int:
        return hash((self._shape, tuple(self._axis_names), tuple(self._devices.ravel())))

    def __repr__(self) -> str:
        return f"<DeviceMesh shape={self._shape}, axis_names={self._axis_names}>"
