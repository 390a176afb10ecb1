"""``TensorLayout`` (how one tensor is spread over a mesh) and ``LayoutMap`` (path -> layout).

Paths are PyTorch ``named_parameters()`` names (``"d1.weight"``); a module's output is
addressed as ``"<module path>/output"`` (``"d2/output"``). Remember that torch ``Linear``
weights are ``(out_features, in_features)``: Keras' kernel layout ``(None, "model")`` is
``("model", None)`` here.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from typing import Iterator, Sequence

from .mesh import DeviceMesh


class TensorLayout:
    """Axes of the mesh that each tensor dim is split over (``None`` = replicated).

    >>> TensorLayout(("model", None)).axes
    ('model', None)
    """

    def __init__(self, axes: Sequence[str | None], device_mesh: DeviceMesh | None = None):
        if isinstance(axes, str):
            raise TypeError(f"axes must be a tuple of axis names or None, not a string. Received: axes={axes!r}")
        self._axes = tuple(axes)
        for axis in self._axes:
            if axis is not None and not isinstance(axis, str):
                raise TypeError(f"Each layout axis must be a mesh axis name or None. Received: axes={self._axes!r}")
        used = [a for a in self._axes if a is not None]
        if len(set(used)) != len(used):
            raise ValueError(f"A mesh axis may shard at most one tensor dim. Received: axes={self._axes!r}")
        self._device_mesh: DeviceMesh | None = None
        if device_mesh is not None:
            self.device_mesh = device_mesh

    @property
    def axes(self) -> tuple[str | None, ...]:
        return self._axes

    @property
    def device_mesh(self) -> DeviceMesh | None:
        return self._device_mesh

    @device_mesh.setter
    def device_mesh(self, device_mesh: DeviceMesh) -> None:
        if self._device_mesh is not None and self._device_mesh != device_mesh:
            raise ValueError(
                f"Cannot override the device mesh of a TensorLayout. Received: device_mesh={device_mesh!r}, "
                f"current={self._device_mesh!r}"
            )
        for axis in self._axes:
            if axis is not None and axis not in device_mesh.axis_names:
                raise ValueError(
                    f"Layout axis {axis!r} is not an axis of the mesh {device_mesh.axis_names}. "
                    f"Received: axes={self._axes!r}"
                )
        self._device_mesh = device_mesh

    def validate_for_shape(self, shape: Sequence[int], path: str = "<tensor>") -> None:
        """Raise ValueError unless this layout can be laid over a tensor of ``shape``."""
        shape = tuple(int(s) for s in shape)
        if len(self._axes) != len(shape):
            raise ValueError(
                f"Layout for {path!r} has {len(self._axes)} axes but the tensor has {len(shape)} dims. "
                f"Received: axes={self._axes!r}, shape={shape}"
            )
        if self._device_mesh is None:
            return
        for dim, (axis, size) in enumerate(zip(self._axes, shape)):
            if axis is None:
                continue
            parts = self._device_mesh.axis_size(axis)
            if size % parts:
                raise ValueError(
                    f"Dim {dim} of {path!r} (size {size}) is not divisible by mesh axis {axis!r} "
                    f"(size {parts}); trainmesh shards evenly only. Received: shape={shape}, axes={self._axes!r}"
                )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorLayout) and self._axes == other._axes and self._device_mesh == other._device_mesh

    def __hash__(self) -> int:
        return hash(self._axes)

    def __repr__(self) -> str:
        return f"<TensorLayout axes={self._axes}, device_mesh={self._device_mesh!r}>"


class LayoutMap(MutableMapping):
    """A dict from path patterns to layouts; lookups fall back to ``re.fullmatch`` on every key.

    An exact key wins; otherwise each key is a regex matched against the whole path. Two or
    more matches raise ValueError; no match returns None.

    >>> mesh = DeviceMesh((2, 2), ["data", "model"], devices=[f"cpu:{i}" for i in range(4)])
    >>> layout_map = LayoutMap(mesh)
    >>> layout_map["d1.weight"] = ("model", None)
    >>> layout_map["d1.weight"].axes
    ('model', None)
    >>> layout_map["d2.weight"] is None
    True
    """

    def __init__(self, device_mesh: DeviceMesh | None = None):
        self._layouts: dict[str, TensorLayout] = {}
        self._device_mesh = device_mesh
        # experts laid over an axis split over groups of this many processes (None: the whole axis)
        self.expert_parallel_size: int | None = None

    @property
    def device_mesh(self) -> DeviceMesh | None:
        return self._device_mesh

    @classmethod
    def auto(
        cls,
        model,
        device_mesh: DeviceMesh,
        *,
        model_axis: str | None = None,
        verbose: bool = True,
        expert_axis: str | None = None,
        expert_parallel_size: int | None = None,
    ) -> "LayoutMap":
        """A tensor-parallel layout for ``model``: its own plan if it ships one (transformers'
        ``base_model_tp_plan``), else one derived from its module tree (attention / MLP units
        column- then row-wise, embedding and head vocab-parallel, norms replicated). Printed.
        See :mod:`trainmesh.distribution.auto_layout`. ``expert_axis`` lays a mixture of experts'
        expert dim over that axis (expert parallelism, :mod:`trainmesh.distribution.expert_layout`);
        ``expert_parallel_size`` splits them over groups of that many processes of the axis instead of
        the whole axis (EP 2 on a batch axis of 4).

        >>> layout_map = LayoutMap.auto(model, mesh)                  # doctest: +SKIP
        >>> tm.ModelParallel(layout_map=layout_map, batch_dim_name="data")  # doctest: +SKIP
        """
        from .auto_layout import auto_layout_map

        return auto_layout_map(
            model,
            device_mesh,
            model_axis=model_axis,
            verbose=verbose,
            expert_axis=expert_axis,
            expert_parallel_size=expert_parallel_size,
        )

    def __getitem__(self, key: str) -> TensorLayout | None:
        if key in self._layouts:
            return self._layouts[key]
        matches = [k for k in self._layouts if re.fullmatch(k, key)]
        if len(matches) > 1:
            raise ValueError(
                f"Path {key!r} matches more than one key of the LayoutMap: {matches}. Make the keys mutually exclusive."
            )
        return self._layouts[matches[0]] if matches else None

    def __setitem__(self, key: str, layout: TensorLayout | Sequence[str | None]) -> None:
        if not isinstance(key, str):
            raise TypeError(f"LayoutMap keys are path strings or regexes. Received: key={key!r}")
        if key in self._layouts:
            raise ValueError(
                f"{key!r} already exists in the LayoutMap with value {self._layouts[key]!r}. "
                "Delete it first to replace it."
            )
        try:
            re.compile(key)
        except re.error as exc:
            raise ValueError(f"LayoutMap key is not a valid regex ({exc}). Received: key={key!r}") from None
        if isinstance(layout, (tuple, list)):
            layout = TensorLayout(layout)
        elif not isinstance(layout, TensorLayout):
            raise ValueError(
                f"{layout!r} must be a TensorLayout or a tuple/list of axis names. Received: {key!r}={layout!r}"
            )
        if layout.device_mesh is None and self._device_mesh is not None:
            layout.device_mesh = self._device_mesh
        self._layouts[key] = layout

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]  # exact key only: deleting by regex would be a surprise

    def __contains__(self, key: object) -> bool:
        return key in self._layouts  # exact keys, as a dict would answer

    def __len__(self) -> int:
        return len(self._layouts)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __repr__(self) -> str:
        return f"<LayoutMap {dict((k, v.axes) for k, v in self._layouts.items())}>"
