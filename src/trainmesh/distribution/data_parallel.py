"""``DataParallel``: weights replicated everywhere, every batch split over one mesh axis."""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from .backend import engine
from .distribution import Distribution, variable_path_and_shape
from .layout import TensorLayout
from .memory_options import MemoryOptions
from .pipeline import Pipeline, check_pipeline_axis
from .mesh import DeviceMesh, _default_devices
from .sequence_split import build_sequence_split


class DataParallel(Distribution):
    """Data parallelism (Keras ``keras.distribution.DataParallel``).

    With no argument every process of the job is one replica (axis ``"batch"``). Given a
    mesh, its first axis is the batch axis. Underneath: torch ``DistributedDataParallel``
    (bucketed all-reduce overlapped with backward).

    ``zero_stage`` 1-3 shards optimizer state / + gradients / + parameters over the batch axis
    (FSDP2, see ``MemoryOptions``); ``shard_unit`` picks the FSDP units (a module class,
    a tuple of classes, or an int byte threshold; default: each block of the first
    ``nn.ModuleList``); ``cpu_offload`` keeps FSDP2 state in host memory (CUDA only, a no-op
    with a warning on CPU); ``reduce_dtype`` is the gradient-reduction dtype under mixed
    precision; ``keep_frozen_gathered`` (``True``, ``False``, ``"auto"``) keeps, at stage 3, the frozen
    sub-modules of each unit (a LoRA base) gathered from forward to backward: one all-gather a step
    instead of two (``"auto"``: while they hold at most 2 GiB). See
    :class:`~trainmesh.distribution.memory_options.MemoryOptions`.

    ``sequence_dim_name`` names a sequence axis of a 2-D ``data x seq`` mesh (or a 1-D ``seq`` one):
    each training sequence is split over it (context parallelism, ``context_parallel="ring"``,
    ``"ulysses"`` or ``"auto"``; see ``docs/long_context.md``) and gradients are averaged over both axes.

    >>> DataParallel(devices=["cpu:0", "cpu:1"], zero_stage=3).zero_stage
    3
    >>> dp = DataParallel(devices=["cpu:0", "cpu:1"])
    >>> dp.batch_dim_name, dp.device_mesh.shape
    ('batch', (2,))
    """

    def __init__(
        self,
        device_mesh: DeviceMesh | None = None,
        devices: Sequence[str] | None = None,
        auto_shard_dataset: bool = True,
        *,
        zero_stage: int = 0,
        shard_unit: Any = None,
        cpu_offload: bool = False,
        reduce_dtype: Any = None,
        keep_frozen_gathered: bool | str = "auto",
        pipeline: Pipeline | None = None,
        sequence_dim_name: str | None = None,
        context_parallel: str = "auto",
    ):
        self._memory = MemoryOptions(
            zero_stage=zero_stage,
            shard_unit=shard_unit,
            cpu_offload=cpu_offload,
            reduce_dtype=reduce_dtype,
            keep_frozen_gathered=keep_frozen_gathered,
        )
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
        self._pipeline = check_pipeline_axis(pipeline, device_mesh)
        batch_axis = next(
            (a for a in device_mesh.axis_names if (pipeline is None or a != pipeline.axis) and a != sequence_dim_name),
            None,
        )
        self._sequence = build_sequence_split(
            device_mesh, sequence_dim_name, context_parallel, batch_dim_name=batch_axis, pipeline=pipeline
        )
        if pipeline is not None and len(device_mesh.axis_names) > 2:
            raise ValueError(
                f"DataParallel with a pipeline takes a 2-D mesh (pipe, batch); for more axes use "
                f"ModelParallel. Received: axes {device_mesh.axis_names}"
            )
        elif pipeline is None and len(device_mesh.axis_names) > 1 + (sequence_dim_name is not None):
            # Keras does the same: DataParallel is 1-D; the model is replicated over the other axes.
            warnings.warn(
                f"DataParallel expects a 1-D mesh; got axes {device_mesh.axis_names}. The first axis "
                f"{device_mesh.axis_names[0]!r} is used as the batch axis and the model is replicated "
                f"over the others.",
                UserWarning,
                stacklevel=2,
            )
        super().__init__(device_mesh, batch_dim_name=batch_axis, auto_shard_dataset=auto_shard_dataset)

    @property
    def pipeline(self) -> Pipeline | None:
        return self._pipeline

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        _, shape = variable_path_and_shape(variable)
        return TensorLayout((None,) * len(shape), self.device_mesh)

    def distribute_model(self, model, *, weights=None, init_seed=None, **ddp_options):
        """Replicate ``model`` (identical on every process at start) under DDP; returns the DDP module
        (or the module itself when the batch axis has a single process: nothing to average).
        With ``zero_stage`` 1, 2 or 3 the FSDP2-sharded module is returned instead.

        ``model`` may be built under ``with torch.device("meta"):``: only this process's shards are
        then allocated, filled from ``weights`` (a Hugging Face checkpoint directory or a
        ``.safetensors`` file, read shard by shard) or by the model's initialisers (``init_seed``).

        ``ddp_options`` go to ``DistributedDataParallel`` (``find_unused_parameters``,
        ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``, ...), stage 0 only.
        """
        return engine("apply_model")(model, self, ddp_options=ddp_options, weights=weights, init_seed=init_seed)

    def prepare_optimizer(self, optimizer, model):
        """Stages 1-3: the same optimizer with its state sharded (over FSDP2's parameter shards it is
        the optimizer itself, stepped with torch's fused or foreach kernels unless the user chose;
        a ``ZeroRedundancyOptimizer`` over replicated parameters otherwise).

        The stage is the one ``model`` was distributed with (a Trainer's ``zero_stage`` may
        override the distribution's)."""
        stage = getattr(model, "_trainmesh_memory", {}).get("zero_stage", self._memory.zero_stage)
        if stage == 0:
            return optimizer
        return engine("prepare_optimizer")(optimizer, self, zero_stage=stage)
