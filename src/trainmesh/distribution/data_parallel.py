"""``DataParallel``: weights replicated everywhere, every batch split over one mesh axis."""

from __future__ import annotations

from typing import Any, Sequence

from .distribution import Distribution, variable_path_and_shape
from .layout import TensorLayout
from .mesh import DeviceMesh, _default_devices


class DataParallel(Distribution):
    """Data parallelism (Keras ``keras.distribution.DataParallel``).

    With no argument every process of the job is one replica (axis ``"batch"``). Given a
    mesh, its first axis is the batch axis. Underneath: torch ``DistributedDataParallel``
    (bucketed all-reduce overlapped with backward).

    >>> dp = DataParallel(devices=["cpu:0", "cpu:1"])
    >>> dp.batch_dim_name, dp.device_mesh.shape
    ('batch', (2,))
    """

    def __init__(self, device_mesh: DeviceMesh | None = None, devices: Sequence[str] | None = None,
                 auto_shard_dataset: bool = True):
        if device_mesh is not None and devices is not None:
            raise ValueError(
                "Pass either device_mesh or devices to DataParallel, not both. "
                f"Received: device_mesh={device_mesh!r}, devices={list(devices)!r}"
            )
        if device_mesh is None:
            devices = list(devices) if devices is not None else _default_devices()
            if not devices:
                raise ValueError(f"DataParallel needs at least one device. Received: devices={devices!r}")
            device_mesh = DeviceMesh(shape=(len(devices),), axis_names=["batch"], devices=devices)
        elif not isinstance(device_mesh, DeviceMesh):
            raise ValueError(f"device_mesh must be a trainmesh DeviceMesh. Received: device_mesh={device_mesh!r}")
        super().__init__(device_mesh, batch_dim_name=device_mesh.axis_names[0], auto_shard_dataset=auto_shard_dataset)

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        _, shape = variable_path_and_shape(variable)
        return TensorLayout((None,) * len(shape), self.device_mesh)

    def distribute_model(self, model, **ddp_options):
        """Replicate ``model`` (identical on every process at start) under DDP; returns the DDP module
        (or the module itself when the batch axis has a single process: nothing to average).

        ``ddp_options`` go to ``DistributedDataParallel`` (``find_unused_parameters``,
        ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``, ...).
        """
        from trainmesh._torch.data_parallel import apply_data_parallel

        return apply_data_parallel(model, self, **ddp_options)
