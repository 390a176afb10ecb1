"""Pipeline receives posted when the step starts, on CPU (gloo).

torch's schedules post each receive when its microbatch is due: a stage asks for its input only
once it is ready to compute on it (``Schedule1F1B``, ``ScheduleGPipe``), or at the end of the time
step in which its neighbour computes it (the multi-stage schedules, in lock-step). Over gloo's TCP
transport a receive is a rendezvous (the receiver announces its buffer, then the sender's data
flows), so every microbatch then waits a round trip and the copy with nothing to do. On 2
processes with 8 microbatches GPipe idled 1.54x its theoretical bubble that way; with the step's
receives posted when it starts, the data lands while the stage is still computing the microbatch
before, and it idled 1.18x.

Why this is safe:

* every receive has its own buffer: torch makes one per microbatch and stage when the schedule
  first runs, and keeps them from step to step;
* gloo pairs sends and receives by peer and tag in the order they are posted, and torch posts
  every receive with tag 0. The first step runs as torch runs it, and :class:`ReceivePlan` records
  the order its stages asked for their receives in; every later step posts the same receives in
  that same order, only earlier, so each message lands in the buffer it landed in before (the
  schedule is the same every step);
* sends never wait for anything but receives that are already posted, so no schedule order can
  deadlock on them;
* not on NCCL: a receive posted there occupies the pair's stream, and a send to the same peer
  queued behind it would wait for a message that needs that send first.

The schedule still asks for each receive (``get_fwd_recv_ops`` / ``get_bwd_recv_ops``); it gets
none and goes on. The stage waits for the posted one when it consumes it (``forward_one_chunk`` /
``backward_one_chunk``) and adds the wait to ``receive_wait_s``: idle time, not compute.
"""

from __future__ import annotations

import time

import torch.distributed as dist


class ReceivesPostedAhead:
    """Mixin for torch's ``PipelineStage`` (listed before it): receives posted by a :class:`ReceivePlan`
    are handed to the schedule as already done, and waited for where they are consumed."""

    receive_wait_s = 0.0  # seconds spent waiting for posted receives (a benchmark reads it)
    steps_posted_ahead = 0
    _recording: list | None = None  # a ReceivePlan's, while it records a step

    def _post(self, kind: str, chunk: int) -> None:
        from torch.distributed.pipelining.schedules import _batch_p2p

        self._posted_ops()[(kind, chunk)] = _batch_p2p(self._torch_recv_ops(kind, chunk))

    def _torch_recv_ops(self, kind: str, chunk: int) -> list:
        """torch's own receive ops for activations (``"fwd"``) or gradients (``"bwd"``)."""
        return super().get_fwd_recv_ops(chunk) if kind == "fwd" else super().get_bwd_recv_ops(chunk)

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        return self._recv_ops("fwd", fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        return self._recv_ops("bwd", bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self._await("fwd", fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self._await("bwd", bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def _recv_ops(self, kind: str, chunk: int) -> list:
        if (kind, chunk) in self._posted_ops():
            return []
        ops = self._torch_recv_ops(kind, chunk)
        if ops and self._recording is not None:
            self._recording.append((self, kind, chunk))
        return ops

    def _posted_ops(self) -> dict:
        if "_posted" not in self.__dict__:
            self._posted = {}
        return self._posted

    def _await(self, kind: str, chunk: int) -> None:
        works = self._posted_ops().pop((kind, chunk), None)
        if works:
            start = time.perf_counter()
            for work in works:
                work.wait()
            self.receive_wait_s += time.perf_counter() - start


class ReceivePlan:
    """One process's stages: records the order of their receives in a step posted as torch posts them,
    then posts every later step's receives in that order when it starts."""

    def __init__(self, stages: list) -> None:
        self.stages = stages
        self.order: list[tuple] | None = None
        self._recording: list | None = None  # the step being recorded (its stages append to it)

    def before_step(self, schedule) -> None:
        leftover = sum(len(stage._posted_ops()) for stage in self.stages)
        if leftover:
            raise RuntimeError(
                f"{leftover} pipeline receive(s) of the last step were never consumed; "
                "a step that failed part-way cannot be resumed"
            )
        if self.order is not None and _initialized(schedule):
            for stage, kind, chunk in self.order:
                stage._post(kind, chunk)
            for stage in self.stages:
                stage.steps_posted_ahead += 1
            return
        self._recording = []
        for stage in self.stages:
            stage._recording = self._recording

    def after_step(self) -> None:
        for stage in self.stages:
            stage._recording = None
        if self._recording is not None:
            self.order, self._recording = self._recording, None


def _initialized(schedule) -> bool:
    """The schedule made its stages' buffers already, for this mode (it remakes them when switching
    between training and forward-only, which would leave posted receives on the old ones)."""
    fwd = getattr(schedule, "_stage_forward_initialized", getattr(schedule, "_stages_forward_initialized", False))
    bwd = getattr(schedule, "_stage_backward_initialized", getattr(schedule, "_stages_backward_initialized", None))
    return bool(fwd) and bwd == schedule._has_backward


def posts_receives_ahead(stages: list, group) -> bool:
    """Whether a runner's stages can post their receives ahead: CPU tensors over gloo (see the module
    docstring for why not on NCCL)."""
    return all(stage.device.type == "cpu" for stage in stages) and "gloo" in str(dist.get_backend(group))
