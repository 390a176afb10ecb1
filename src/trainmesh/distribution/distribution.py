"""``Distribution``: the base of every front end, plus the global ``set_distribution`` state.

A distribution answers *where tensors live* (``get_data_layout``, ``get_variable_layout``,
``get_tensor_layout``) without touching torch.distributed; ``distribute_model`` and
``distribute_dataset`` turn the answers into torch machinery, through the engine registered in
``backend`` (torch's, by the package root): the front end never imports ``trainmesh._torch``.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Iterator, Sequence

from .layout import TensorLayout
from .memory_options import MemoryOptions
from .mesh import DeviceMesh

# Process-wide, not per thread: data-loading and monitoring threads must see the same one.
_current: list["Distribution | None"] = [None]


class Distribution(abc.ABC):
    """Base class: a device mesh, the name of its batch axis, and layout rules."""

    def __init__(self, device_mesh: DeviceMesh, batch_dim_name: str | None = None, auto_shard_dataset: bool = True):
        if not isinstance(device_mesh, DeviceMesh):
            raise ValueError(f"device_mesh must be a trainmesh DeviceMesh. Received: device_mesh={device_mesh!r}")
        if batch_dim_name is not None and batch_dim_name not in device_mesh.axis_names:
            raise ValueError(
                f"batch_dim_name {batch_dim_name!r} is not an axis of the mesh {device_mesh.axis_names}. "
                f"Received: batch_dim_name={batch_dim_name!r}"
            )
        self._device_mesh = device_mesh
        self._batch_dim_name = batch_dim_name
        self._auto_shard_dataset = bool(auto_shard_dataset)

    # --- Keras attributes -------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._device_mesh

    @property
    def batch_dim_name(self) -> str | None:
        return self._batch_dim_name

    # A sequence axis (context parallelism, ``sequence_split.py``): set by subclasses that take one.
    _sequence = None

    @property
    def sequence(self):
        """The :class:`~trainmesh.distribution.sequence_split.SequenceSplit` over a sequence axis, or ``None``."""
        return self._sequence

    @property
    def memory(self) -> "MemoryOptions":
        """ZeRO stage, shard unit, CPU offload and reduce dtype over the batch axis."""
        return getattr(self, "_memory", None) or MemoryOptions()

    @property
    def zero_stage(self) -> int:
        return self.memory.zero_stage

    @property
    def auto_shard_dataset(self) -> bool:
        return self._auto_shard_dataset

    @auto_shard_dataset.setter
    def auto_shard_dataset(self, value: bool) -> None:
        self._auto_shard_dataset = bool(value)

    # --- layout queries (pure metadata) -----------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        """How many ways a global batch is split: the size of the batch axis (1 without one)."""
        return self._device_mesh.axis_size(self._batch_dim_name) if self._batch_dim_name else 1

    def get_data_layout(self, data_shape: Sequence[int]) -> TensorLayout:
        """Layout of an input batch of global shape ``data_shape``: dim 0 over the batch axis."""
        data_shape = tuple(data_shape)
        if not data_shape:
            raise ValueError(f"A batch needs at least one dim (the batch dim). Received: data_shape={data_shape}")
        self.validate_global_batch(data_shape[0])
        layout = TensorLayout((self._batch_dim_name,) + (None,) * (len(data_shape) - 1), self._device_mesh)
        return layout

    def validate_global_batch(self, global_batch_size: int) -> None:
        if global_batch_size < 1 or global_batch_size % self.data_parallel_size:
            raise ValueError(
                f"The global batch size must be a positive multiple of the batch axis "
                f"{self._batch_dim_name!r} (size {self.data_parallel_size}). "
                f"Received: global_batch_size={global_batch_size}"
            )

    @abc.abstractmethod
    def get_variable_layout(self, variable: Any) -> TensorLayout:
        """Layout of a parameter: ``variable`` has ``.path`` and ``.shape``, or is a ``(path, tensor)`` pair."""

    def get_tensor_layout(self, path: str) -> TensorLayout | None:
        return None

    # --- placement of this process -------------------------------------------------------
    def data_index(self, rank: int | None = None) -> int:
        """Which slice of every global batch process ``rank`` (default: this one) consumes."""
        if rank is None:
            from trainmesh.runtime import rank as current_rank

            rank = current_rank()
        coordinate = self._device_mesh.coordinate_of(rank)
        if coordinate is None:
            raise ValueError(f"Process {rank} is not a device of the mesh {self._device_mesh.devices.ravel().tolist()}")
        if self._batch_dim_name is None:
            return 0
        return coordinate[self._device_mesh.axis_index(self._batch_dim_name)]

    # --- scope ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator["Distribution"]:
        """Make this the current distribution inside the ``with`` block; the previous one
        is restored on exit, even on an exception (Keras semantics)."""
        previous = distribution()
        set_distribution(self)
        try:
            yield self
        finally:
            set_distribution(previous)

    # --- applying it ---------------------------------------------------------------------
    @abc.abstractmethod
    def distribute_model(self, model):
        """Place ``model``'s parameters per this distribution; returns the model to train."""

    def prepare_optimizer(self, optimizer, model):
        """The optimizer to train ``model`` (already distributed) with; identity unless a
        distribution shards optimizer state (``DataParallel(zero_stage=1)``)."""
        return optimizer

    def distribute_dataset(
        self, dataset, global_batch_size: int, *, shuffle: bool = False, seed: int = 0, drop_remainder: bool = False
    ):
        """This process's iterable of local batches of ``dataset`` (global-batch semantics).

        Every global batch of ``global_batch_size`` samples is split over the batch axis;
        processes sharing a data index get the same samples. Reshuffles every epoch
        (each ``iter()``) when ``shuffle``, from ``seed``, identically on every process.
        """
        from .dataset import DistributedBatches

        self.validate_global_batch(global_batch_size)
        if not self._auto_shard_dataset:
            data_parallel_size, data_index = 1, 0
        else:
            data_parallel_size, data_index = self.data_parallel_size, self.data_index()
        return DistributedBatches(
            dataset,
            global_batch_size=global_batch_size,
            data_parallel_size=data_parallel_size,
            data_index=data_index,
            shuffle=shuffle,
            seed=seed,
            drop_remainder=drop_remainder,
            to_global=self._batch_to_global,
        )

    def _batch_to_global(self, local_batch, device=None):
        """This process's share of a batch as its model takes it: on the model's device (a GPU's;
        unchanged on CPU; ``device``: that device, when the caller has it already). A hook for
        subclasses whose models take global (DTensor) batches."""
        from trainmesh.runtime import to_local_device

        batch = to_local_device(local_batch, device)
        if self._sequence is not None:  # training batches over a sequence axis: this process's chunks
            batch = self._sequence.split_batch(batch, self._sequence.index_of(self._device_mesh))
        return batch

    def _batch_to_global_rows(self, local_batch, global_rows: int):
        """As ``_batch_to_global``, for unequal shares of a batch of ``global_rows`` rows (evaluation and
        prediction: whole sequences here; over a sequence axis the model splits them and gathers its
        outputs back, ``_torch/context_parallel_eval.py``)."""
        if self._sequence is not None:
            from trainmesh.runtime import to_local_device

            return to_local_device(local_batch)
        return self._batch_to_global(local_batch)

    def global_mean(self, value):
        """``value`` (a loss or metric computed on this process's batch) as a one-device run reports it."""
        from .backend import engine

        return engine("global_mean")(value)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} mesh={self._device_mesh!r}, batch_dim_name={self._batch_dim_name!r}>"


def variable_path_and_shape(variable: Any) -> tuple[str, tuple[int, ...]]:
    """Accept Keras-like variables (``.path``, ``.shape``) and torch ``(name, parameter)`` pairs."""
    if isinstance(variable, tuple) and len(variable) == 2 and isinstance(variable[0], str):
        path, tensor = variable
        return path, tuple(tensor.shape)
    path, shape = getattr(variable, "path", None), getattr(variable, "shape", None)
    if not isinstance(path, str) or shape is None:
        raise TypeError(
            "A variable is a (path, tensor) pair from named_parameters() or an object with .path and .shape. "
            f"Received: variable={variable!r}"
        )
    return path, tuple(shape)


def set_distribution(value: Distribution | None) -> None:
    """Set the process-wide distribution (``None`` clears it)."""
    if value is not None and not isinstance(value, Distribution):
        raise ValueError(f"set_distribution expects a Distribution or None. Received: value={value!r}")
    _current[0] = value


def distribution() -> Distribution | None:
    """The distribution in force (the innermost ``scope()``'s, or ``set_distribution``'s)."""
    return _current[0]
