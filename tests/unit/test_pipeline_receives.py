"""Receives posted when a pipeline step starts (_torch/pipeline_receives.py), on stand-in stages: the
first step records the order the schedule asks for its receives in, later steps post them in that
order before the schedule runs, the schedule gets none to post, and each is waited for where it is
consumed. (The real thing, against one process, for every schedule: tests/multiprocess/test_pipeline.py.)"""

import pytest

import trainmesh._torch.pipeline_receives as receives
from trainmesh._torch.pipeline_receives import ReceivePlan, ReceivesPostedAhead

pytestmark = pytest.mark.timeout(60)


class FakeWork:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(("wait", self.name))


class TorchStageStandIn:
    """What the mixin calls on torch's PipelineStage: receive ops per microbatch, compute per chunk.
    The first stage receives no activations and the last no gradients, as in torch."""

    def __init__(self, index, num_stages, log):
        self.stage_index, self.num_stages, self.log = index, num_stages, log

    def get_fwd_recv_ops(self, chunk):
        return [] if self.stage_index == 0 else [f"recv act s{self.stage_index} mb{chunk}"]

    def get_bwd_recv_ops(self, chunk):
        return [] if self.stage_index == self.num_stages - 1 else [f"recv grad s{self.stage_index} mb{chunk}"]

    def forward_one_chunk(self, chunk, *args, **kwargs):
        self.log.append(("forward", self.stage_index, chunk))

    def backward_one_chunk(self, chunk, *args, **kwargs):
        self.log.append(("backward", self.stage_index, chunk))


class Stage(ReceivesPostedAhead, TorchStageStandIn):
    pass


class Schedule:
    """Two stages on this process (0 and 2 of 3), asked for in a fixed interleaved order, the way a
    multi-stage torch schedule posts a receive and waits for it before the compute."""

    _has_backward = True

    def __init__(self, stages, log, initialized=True):
        self.stages, self.log = stages, log
        self._stages_forward_initialized = self._stages_backward_initialized = initialized

    def step(self):
        for kind, stage, chunk in [
            ("fwd", 0, 0),
            ("fwd", 1, 0),
            ("fwd", 0, 1),
            ("fwd", 1, 1),
            ("bwd", 1, 1),
            ("bwd", 0, 1),
            ("bwd", 1, 0),
            ("bwd", 0, 0),
        ]:
            s = self.stages[stage]
            ops = s.get_fwd_recv_ops(chunk) if kind == "fwd" else s.get_bwd_recv_ops(chunk)
            for op in ops:  # posted when due, and waited for at once
                self.log.append(("post", op))
                self.log.append(("wait", op))
            (s.forward_one_chunk if kind == "fwd" else s.backward_one_chunk)(chunk)


def run_step(plan, schedule):
    plan.before_step(schedule)
    schedule.step()
    plan.after_step()


@pytest.fixture
def log(monkeypatch):
    entries = []

    def post(ops):
        for op in ops:
            entries.append(("post", op))
        return [FakeWork(entries, op) for op in ops]

    monkeypatch.setattr("torch.distributed.pipelining.schedules._batch_p2p", post)
    return entries


def test_later_steps_post_the_first_steps_receives_in_its_order_before_the_schedule_runs(log):
    stages = [Stage(0, 3, log), Stage(2, 3, log)]
    plan, schedule = ReceivePlan(stages), Schedule(stages, log)
    run_step(plan, schedule)
    first = list(log)
    asked = [entry[1] for entry in first if entry[0] == "post"]
    assert asked == ["recv act s2 mb0", "recv act s2 mb1", "recv grad s0 mb1", "recv grad s0 mb0"], asked
    assert [s.steps_posted_ahead for s in stages] == [0, 0]

    log.clear()
    plan.before_step(schedule)
    posted = list(log)
    assert posted == [("post", op) for op in asked], "every receive, in the first step's order, before the schedule"
    schedule.step()
    plan.after_step()
    after = log[len(posted) :]
    assert not [entry for entry in after if entry[0] == "post"], "the schedule must get no receive to post"
    # each posted receive is waited for right before the compute that consumes it, and only there
    computes = [entry for entry in first if entry[0] in ("forward", "backward")]
    assert [entry for entry in after if entry[0] != "wait"] == computes
    for i, entry in enumerate(after):
        if entry[0] == "wait":
            kind, stage, mb = after[i + 1]
            assert entry[1] == f"recv {'act' if kind == 'forward' else 'grad'} s{stage} mb{mb}", (entry, after[i + 1])
    assert sorted(entry[1] for entry in after if entry[0] == "wait") == sorted(asked)
    assert [s.steps_posted_ahead for s in stages] == [1, 1]


def test_nothing_is_posted_before_the_schedule_has_made_its_buffers(log):
    stages = [Stage(0, 3, log), Stage(2, 3, log)]
    plan = ReceivePlan(stages)
    run_step(plan, Schedule(stages, log))
    log.clear()
    uninitialized = Schedule(stages, log, initialized=False)  # e.g. remade after a switch to forward-only
    plan.before_step(uninitialized)
    assert log == []
    uninitialized.step()
    assert [s.steps_posted_ahead for s in stages] == [0, 0]


def test_a_step_that_left_posted_receives_unconsumed_is_named_before_the_next(log):
    stages = [Stage(0, 3, log), Stage(2, 3, log)]
    plan, schedule = ReceivePlan(stages), Schedule(stages, log)
    run_step(plan, schedule)
    plan.before_step(schedule)  # posted, then the step fails before consuming them
    with pytest.raises(RuntimeError, match="4 pipeline receive\\(s\\) of the last step were never consumed"):
        plan.before_step(schedule)


def test_only_cpu_stages_over_gloo_post_ahead(monkeypatch):
    class Device:
        def __init__(self, kind):
            self.type = kind

    class Plain:
        def __init__(self, kind):
            self.device = Device(kind)

    monkeypatch.setattr(receives.dist, "get_backend", lambda group: group)
    assert receives.posts_receives_ahead([Plain("cpu")], "gloo")
    assert receives.posts_receives_ahead([Plain("cpu")], "cpu:gloo,cuda:nccl")
    assert not receives.posts_receives_ahead([Plain("cuda")], "nccl")
    assert not receives.posts_receives_ahead([Plain("cuda")], "cpu:gloo,cuda:nccl")
