"""``MeshSpec``: the mesh a plan is for (``"pipe=8,data=16,model=8"``), validated before anything runs,
and turned into the same front-end distribution a training script would write.

Axis roles follow the names: ``pipe`` splits layers (``tm.Pipeline``), ``model`` (or ``tensor``)
shards layers (``ModelParallel`` with ``LayoutMap.auto``), any other axis is the batch axis
(``data``, ``batch``, ``dp``). Ranks are laid out row-major (the last axis varies fastest), as
``DeviceMesh`` and torchrun number them: on 8-GPU nodes, ``model=8`` last keeps tensor
parallelism inside a node.

>>> spec = MeshSpec.parse("pipe=2,data=4,model=2", world_size=16)
>>> spec.coords(5), spec.representative_ranks()
({'pipe': 0, 'data': 2, 'model': 1}, [0, 8])
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

MODEL_AXES = ("model", "tensor", "tp")
PIPE_AXES = ("pipe", "pp", "pipeline")


@dataclass(frozen=True)
class MeshSpec:
    axes: tuple[tuple[str, int], ...]
    world_size: int

    @classmethod
    def parse(cls, text: str | None, world_size: int) -> "MeshSpec":
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1. Received: world_size={world_size!r}")
        if text is None or not str(text).strip():
            return cls((("data", world_size),), world_size)
        axes = []
        for part in str(text).split(","):
            match = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+)\s*", part)
            if match is None:
                raise ValueError(
                    f"A mesh is written axis=size,axis=size (e.g. pipe=8,data=16,model=8). Received: mesh={text!r}"
                )
            axes.append((match.group(1), int(match.group(2))))
        names = [a for a, _ in axes]
        if len(set(names)) != len(names) or any(s < 1 for _, s in axes):
            raise ValueError(f"Mesh axes must be distinct and of size >= 1. Received: mesh={text!r}")
        size = math.prod(s for _, s in axes)
        if size != world_size:
            raise ValueError(
                f"The mesh {text!r} multiplies to {size} ranks, not the world size {world_size}. "
                f"Received: mesh={text!r}, world_size={world_size}"
            )
        spec = cls(tuple(axes), world_size)
        if len([a for a in names if a in MODEL_AXES]) > 1 or len([a for a in names if a in PIPE_AXES]) > 1:
            raise ValueError(f"At most one model axis {MODEL_AXES} and one pipe axis {PIPE_AXES}. Received: {text!r}")
        if not spec.batch_axis:
            raise ValueError(f"The mesh needs a batch axis (e.g. data=1). Received: mesh={text!r}")
        return spec

    @property
    def names(self) -> list[str]:
        return [a for a, _ in self.axes]

    def size(self, axis: str | None) -> int:
        return dict(self.axes).get(axis, 1) if axis else 1

    @property
    def model_axis(self) -> str | None:
        return next((a for a in self.names if a in MODEL_AXES), None)

    @property
    def pipe_axis(self) -> str | None:
        return next((a for a in self.names if a in PIPE_AXES), None)

    @property
    def batch_axis(self) -> str | None:
        return next((a for a in self.names if a not in MODEL_AXES + PIPE_AXES), None)

    def text(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.axes)

    def coords(self, rank: int) -> dict[str, int]:
        index = np.unravel_index(rank, [s for _, s in self.axes])
        return {a: int(i) for a, i in zip(self.names, index)}

    def rank_of(self, **coords: int) -> int:
        return int(np.ravel_multi_index([coords.get(a, 0) for a in self.names], [s for _, s in self.axes]))

    def representative_ranks(self) -> list[int]:
        """One rank per pipeline stage (stages hold different layers); within a stage, coordinate 0 on
        every other axis, which holds the largest shard (FSDP2 and DTensor put the remainder first)."""
        pipe = self.pipe_axis
        return [self.rank_of(**({pipe: p} if pipe else {})) for p in range(self.size(pipe))]

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours on ``axis`` (1 for the last axis)."""
        sizes = [s for _, s in self.axes]
        return math.prod(sizes[self.names.index(axis) + 1 :])

    def distribution(self, model, *, zero_stage: int, microbatches: int = 1, schedule: str = "1f1b"):
        """The front-end distribution a script would write for this mesh (public API only)."""
        from trainmesh.distribution import DataParallel, DeviceMesh, LayoutMap, ModelParallel

        devices = [f"cpu:{i}" for i in range(self.world_size)]
        pipeline = None
        if self.pipe_axis and self.size(self.pipe_axis) > 1:
            from trainmesh.distribution.pipeline import Pipeline

            pipeline = Pipeline(axis=self.pipe_axis, schedule=schedule, microbatches=microbatches)
        model_axis = self.model_axis
        if model_axis and self.size(model_axis) > 1:
            mesh = DeviceMesh([s for _, s in self.axes], self.names, devices=devices)
            layout_map = LayoutMap.auto(model, mesh, model_axis=model_axis, verbose=False)
            if not len(layout_map):
                raise ValueError(
                    f"{type(model).__name__} has no layer that splits over {model_axis}="
                    f"{self.size(model_axis)} (LayoutMap.auto found none); use a smaller model axis. "
                    f"Received: mesh={self.text()!r}"
                )
            return ModelParallel(
                layout_map=layout_map, batch_dim_name=self.batch_axis, zero_stage=zero_stage, pipeline=pipeline
            )
        kept = [(a, s) for a, s in self.axes if a != model_axis]
        if pipeline is not None:
            mesh = DeviceMesh([s for _, s in kept], [a for a, _ in kept], devices=devices)
            return DataParallel(mesh, zero_stage=zero_stage, pipeline=pipeline)
        mesh = DeviceMesh((self.world_size,), [self.batch_axis], devices=devices)
        return DataParallel(mesh, zero_stage=zero_stage)
