"""``Pipeline``: pipeline parallelism described, not applied (pure Python, no torch.distributed).

A pipeline splits the model's repeated blocks over a ``pipe`` axis of the mesh: the first
stage also holds what runs before the blocks (embeddings), the last what runs after them
(final norm, head) and the loss. A step's batch (this data replica's share) is cut into
``microbatches`` that flow through the stages in the order of ``schedule``. The schedules
are torch's own (``torch.distributed.pipelining``); this class only names one and checks
what can be checked before any process group exists.

>>> Pipeline(axis="pipe", schedule="1f1b", microbatches=8).stages_per_rank
1
>>> Pipeline(schedule="interleaved_1f1b", microbatches=8).stages_per_rank
2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# name -> (torch class name, stages per rank, needs microbatches >= stages)
SCHEDULES: dict[str, tuple[str, int, bool]] = {
    "gpipe": ("ScheduleGPipe", 1, False),
    "1f1b": ("Schedule1F1B", 1, True),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, True),
    "looped_bfs": ("ScheduleLoopedBFS", 2, False),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, True),
    "zbv": ("ScheduleZBVZeroBubble", 2, True),
}

BALANCE = ("params", "time")


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Pipeline parallelism over one mesh axis.

    axis: the mesh axis whose processes hold consecutive stages.
    schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"looped_bfs"``,
        ``"interleaved_zero_bubble"`` or ``"zbv"`` (torch's schedules of those names).
    microbatches: how many pieces each data replica's batch is cut into per step; they take
        the place of gradient accumulation (a step's gradient is their mean).
    split_points: ``"auto"`` (balance the repeated blocks) or the names of the blocks that
        begin stages 1, 2, ... (``["model.layers.4"]`` splits a Llama into two stages).
    balance: with ``"auto"``, balance blocks by parameter count (``"params"``) or by measured
        forward+backward time of each block (``"time"``, one short timing on the first process).
    stages_per_rank: virtual stages on each process; the schedule's own number by default
        (1 for GPipe and 1F1B, 2 for the interleaved, looped and zero-bubble ones).
    """

    axis: str = "pipe"
    schedule: str = "1f1b"
    microbatches: int = 4
    split_points: str | Sequence[str] = "auto"
    balance: str = "params"
    stages_per_rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis:
            raise ValueError(f"Pipeline axis must be a mesh axis name. Received: axis={self.axis!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"Unknown pipeline schedule. Choose one of {sorted(SCHEDULES)}. Received: schedule={self.schedule!r}"
            )
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive int. Received: microbatches={self.microbatches!r}")
        if self.balance not in BALANCE:
            raise ValueError(f"balance must be one of {BALANCE}. Received: balance={self.balance!r}")
        if isinstance(self.split_points, str):
            if self.split_points != "auto":
                raise ValueError(
                    "split_points is 'auto' or a list of block names that begin stages 1, 2, ... "
                    f"Received: split_points={self.split_points!r}"
                )
        else:
            points = tuple(self.split_points)
            if not all(isinstance(p, str) and p for p in points) or len(set(points)) != len(points):
                raise ValueError(f"split_points must be distinct module names. Received: split_points={points!r}")
            object.__setattr__(self, "split_points", points)
        if self.stages_per_rank is not None:
            if not isinstance(self.stages_per_rank, int) or self.stages_per_rank < 1:
                raise ValueError(f"stages_per_rank must be a positive int. Received: {self.stages_per_rank!r}")
            if SCHEDULES[self.schedule][1] == 1 and self.stages_per_rank != 1:
                raise ValueError(
                    f"Schedule {self.schedule!r} runs one stage per process. "
                    f"Received: stages_per_rank={self.stages_per_rank}"
                )
            if SCHEDULES[self.schedule][1] > 1 and self.stages_per_rank < 2:
                raise ValueError(
                    f"Schedule {self.schedule!r} runs two or more stages per process. "
                    f"Received: stages_per_rank={self.stages_per_rank}"
                )
        else:
            object.__setattr__(self, "stages_per_rank", SCHEDULES[self.schedule][1])

    def num_stages(self, pipe_size: int) -> int:
        return pipe_size * self.stages_per_rank

    def validate(self, pipe_size: int, local_batch: int | None = None) -> None:
        """Checks that need the axis size (and, when known, this replica's batch rows)."""
        stages = self.num_stages(pipe_size)
        needs_more = SCHEDULES[self.schedule][2]
        if needs_more and pipe_size > 1 and self.microbatches < pipe_size:
            raise ValueError(
                f"Schedule {self.schedule!r} needs at least as many microbatches as pipeline ranks "
                f"({pipe_size}). Received: microbatches={self.microbatches}"
            )
        if (
            self.schedule in ("interleaved_1f1b", "interleaved_zero_bubble")
            and pipe_size > 1
            and self.microbatches % pipe_size
        ):
            raise ValueError(
                f"Schedule {self.schedule!r} needs microbatches to be a multiple of the pipeline ranks "
                f"({pipe_size}). Received: microbatches={self.microbatches}"
            )
        if self.schedule == "zbv" and self.stages_per_rank != 2:
            raise ValueError(
                f"Schedule 'zbv' runs exactly two stages per process. Received: stages_per_rank={self.stages_per_rank}"
            )
        if not isinstance(self.split_points, str) and len(self.split_points) != stages - 1:
            raise ValueError(
                f"{stages} stages need {stages - 1} split points. Received: split_points={list(self.split_points)}"
            )
        if local_batch is not None and local_batch % self.microbatches:
            raise ValueError(
                f"Each data replica's batch ({local_batch} rows) must divide into {self.microbatches} "
                f"microbatches. Received: local batch {local_batch}, microbatches={self.microbatches}"
            )

    def describe(self, pipe_size: int) -> str:
        return (
            f"pipeline over {self.axis!r}: {self.num_stages(pipe_size)} stages on {pipe_size} processes, "
            f"schedule {self.schedule}, {self.microbatches} microbatches"
        )


def check_pipeline_axis(pipeline: "Pipeline | None", mesh) -> "Pipeline | None":
    """The pipeline of a distribution over ``mesh``: its axis must be one of the mesh's."""
    if pipeline is None:
        return None
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline must be a trainmesh Pipeline. Received: pipeline={pipeline!r}")
    if pipeline.axis not in mesh.axis_names:
        raise ValueError(
            f"The pipeline axis {pipeline.axis!r} is not an axis of the mesh {mesh.axis_names}. "
            f"Received: Pipeline(axis={pipeline.axis!r})"
        )
    if len(mesh.axis_names) < 2:
        raise ValueError(
            f"A pipeline needs a mesh with its own axis plus a batch axis (size 1 is fine), e.g. "
            f"DeviceMesh((2, 1), ['pipe', 'data']). Received: axes {mesh.axis_names}"
        )
    return pipeline
