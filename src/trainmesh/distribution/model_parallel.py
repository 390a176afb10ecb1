"""``ModelParallel``: parameters and module outputs laid out per a ``LayoutMap``."""

from __future__ import annotations

import warnings
from typing import Any

from .backend import engine
from .distribution import Distribution, variable_path_and_shape
from .layout import LayoutMap, TensorLayout
from .memory_options import MemoryOptions
from .pipeline import Pipeline, check_pipeline_axis
from .sequence_split import build_sequence_split


class ModelParallel(Distribution):
    """Model (tensor) parallelism with an optional batch axis (Keras ``ModelParallel``).

    Parameters matched in ``layout_map`` are sharded per their layout (DTensor); the rest
    are replicated; the batch axis (default: the mesh's first axis) splits the data and
    gradients are reduced over it. Changing only the mesh shape (4x1, 2x2, 1x4) changes
    the balance between data and model parallelism; nothing else changes. ``pipeline=``
    (a :class:`Pipeline` naming a ``pipe`` axis) splits the layers over that axis too: the
    3-D layout ``pipe x data x model``. ``sequence_dim_name`` names a sequence axis: each training
    sequence is split over it (context parallelism by ``context_parallel="ring"``, ``"ulysses"`` or
    ``"auto"``; see ``docs/long_context.md``), and gradients are averaged over it and the batch axis.
    ``sequence_parallel=True`` splits the residual stream (norms, residual adds) over the sequence on
    the model axis too (Megatron's sequence parallelism).

    >>> from trainmesh.distribution import DeviceMesh, LayoutMap
    >>> mesh = DeviceMesh((2, 2), ["data", "model"], devices=[f"cpu:{i}" for i in range(4)])
    >>> layout_map = LayoutMap(mesh)
    >>> layout_map["d1.weight"] = ("model", None)
    >>> mp = ModelParallel(layout_map=layout_map, batch_dim_name="data")
    >>> mp.get_variable_layout(("d1.weight", __import__("torch").zeros(200, 784))).axes
    ('model', None)
    """

    def __init__(
        self,
        *,
        layout_map: LayoutMap | None = None,
        batch_dim_name: str | None = None,
        auto_shard_dataset: bool = True,
        zero_stage: int = 0,
        shard_unit: Any = None,
        cpu_offload: bool = False,
        reduce_dtype: Any = None,
        keep_frozen_gathered: bool | str = "auto",
        device_mesh: Any = None,
        pipeline: Pipeline | None = None,
        sequence_dim_name: str | None = None,
        context_parallel: str = "auto",
        sequence_parallel: bool = False,
    ):
        if device_mesh is not None:
            # Keras 3.0's signature took device_mesh too; later versions read it from the layout map.
            warnings.warn(
                "ModelParallel(device_mesh=...) is deprecated, as in Keras: the mesh is the layout "
                "map's (LayoutMap(device_mesh)). The device_mesh argument is ignored.",
                DeprecationWarning,
                stacklevel=2,
            )
        self._memory = MemoryOptions(
            zero_stage=zero_stage,
            shard_unit=shard_unit,
            cpu_offload=cpu_offload,
            reduce_dtype=reduce_dtype,
            keep_frozen_gathered=keep_frozen_gathered,
        )
        if not isinstance(layout_map, LayoutMap):
            raise ValueError(f"ModelParallel needs a LayoutMap. Received: layout_map={layout_map!r}")
        mesh = layout_map.device_mesh
        if mesh is None:
            raise ValueError("The LayoutMap given to ModelParallel must carry a device mesh: LayoutMap(device_mesh).")
        self._pipeline = check_pipeline_axis(pipeline, mesh)
        if batch_dim_name is None:  # Keras: the first axis; with a pipeline, the first that is not its axis
            batch_dim_name = next(
                (a for a in mesh.axis_names if (pipeline is None or a != pipeline.axis) and a != sequence_dim_name),
                None,
            )
        super().__init__(mesh, batch_dim_name=batch_dim_name, auto_shard_dataset=auto_shard_dataset)
        self._sequence = build_sequence_split(
            mesh, sequence_dim_name, context_parallel, batch_dim_name=batch_dim_name, pipeline=pipeline
        )
        self._layout_map = layout_map
        self._sequence_parallel = _check_sequence_parallel(
            sequence_parallel, mesh, batch_dim_name, self._sequence, pipeline
        )

    @property
    def sequence_parallel(self) -> bool:
        """Whether the residual stream is split over the sequence on the model axis (Megatron's sequence
        parallelism: all-gathers and reduce-scatters instead of all-reduces; ``_torch/sequence_parallel.py``)."""
        return self._sequence_parallel

    @property
    def pipeline(self) -> Pipeline | None:
        return self._pipeline

    @property
    def layout_map(self) -> LayoutMap:
        return self._layout_map

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        path, shape = variable_path_and_shape(variable)
        layout = self._layout_map[path]
        if layout is None:
            return TensorLayout((None,) * len(shape), self.device_mesh)
        layout.validate_for_shape(shape, path)
        return layout

    def get_tensor_layout(self, path: str) -> TensorLayout | None:
        return self._layout_map[path]

    def distribute_model(self, model, *, weights=None, init_seed=None):
        """Shard ``model``'s parameters in place per the layout map (DTensor); returns the model.

        A meta-built ``model`` gets storage for this process's slices only, filled from ``weights``
        (safetensors, each process reading its own byte ranges) or by its initialisers (``init_seed``).
        """
        return engine("apply_model")(model, self, weights=weights, init_seed=init_seed)


def _check_sequence_parallel(enabled: bool, mesh, batch_dim_name, sequence, pipeline) -> bool:
    if not enabled:
        return False
    skip = {batch_dim_name, getattr(sequence, "axis", None), getattr(pipeline, "axis", None)}
    model_axes = [a for a in mesh.axis_names if a not in skip]
    if len(model_axes) != 1:
        raise ValueError(
            f"sequence_parallel=True splits the sequence over the one model axis; the mesh has "
            f"{len(model_axes)}. Received: model axes {model_axes} of mesh axes {mesh.axis_names}"
        )
    return True
