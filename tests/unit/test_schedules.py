"""scale_lr and the warmup schedules, driven through a real optimizer and LambdaLR."""

from __future__ import annotations

import io
import math

import pytest
import torch

from trainmesh.trainer.schedules import WarmupDecay, scale_lr, warmup_cosine, warmup_linear

pytestmark = pytest.mark.timeout(60)


def make_optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def lrs_over(optimizer, scheduler, steps: int, group: int = 0) -> list[float]:
    """The lr each optimizer step runs with, stepping the scheduler once per step."""
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[group]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_scale_lr_rules():
    assert scale_lr(0.1, 1024, 256) == pytest.approx(0.4)
    assert scale_lr(0.1, 1024, 256, rule="sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 64, 256, rule="linear") == pytest.approx(0.025)
    assert scale_lr(3e-4, 256, 256, rule="sqrt") == 3e-4
    assert isinstance(scale_lr(1, 2, 1), float)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(rule="cubic"), "rule='cubic'"),
        (dict(base_lr=-0.1), "base_lr=-0.1"),
        (dict(base_lr=float("nan")), "base_lr=nan"),
        (dict(global_batch=0), "global_batch=0"),
        (dict(base_batch=2.5), "base_batch=2.5"),
        (dict(global_batch=True), "global_batch=True"),
    ],
)
def test_scale_lr_rejects_bad_values(kwargs, fragment):
    args = dict(base_lr=0.1, global_batch=64, base_batch=32) | kwargs
    with pytest.raises(ValueError, match="Received") as info:
        scale_lr(**args)
    assert fragment in str(info.value)


def test_warmup_cosine_shape():
    opt = make_optimizer(1.0)
    sched = warmup_cosine(opt, warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    lrs = lrs_over(opt, sched, 15)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # starts at 1/warmup, not 0
    assert lrs[4] == pytest.approx(1.0)  # first decay step still at the peak
    assert lrs[8] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # never goes back up
    assert lrs[11] > 0.1
    assert lrs[12:] == pytest.approx([0.1, 0.1, 0.1])  # min reached at total_steps, constant after


def test_warmup_linear_shape():
    opt = make_optimizer(2.0)
    sched = warmup_linear(opt, warmup_steps=2, total_steps=6)
    assert lrs_over(opt, sched, 8) == pytest.approx([1.0, 2.0, 2.0, 1.5, 1.0, 0.5, 0.0, 0.0])


def test_no_warmup_starts_at_full_lr_and_warmup_equal_total():
    opt = make_optimizer(1.0)
    assert lrs_over(opt, warmup_cosine(opt, warmup_steps=0, total_steps=2), 3) == pytest.approx([1.0, 0.5, 0.0])
    opt = make_optimizer(1.0)
    lrs = lrs_over(opt, warmup_linear(opt, warmup_steps=2, total_steps=2, min_lr_ratio=0.3), 4)
    assert lrs == pytest.approx([0.5, 1.0, 0.3, 0.3])


def test_each_param_group_scales_its_own_lr():
    opt = make_optimizer(1.0, 0.01)
    sched = warmup_cosine(opt, warmup_steps=2, total_steps=4)
    assert lrs_over(opt, sched, 2, group=1) == pytest.approx([0.005, 0.01])


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(warmup_steps=11, total_steps=10), "warmup_steps=11"),
        (dict(warmup_steps=-1, total_steps=10), "warmup_steps=-1"),
        (dict(warmup_steps=0, total_steps=0), "total_steps=0"),
        (dict(warmup_steps=1.5, total_steps=10), "warmup_steps=1.5"),
        (dict(warmup_steps=1, total_steps=10, min_lr_ratio=1.5), "min_lr_ratio=1.5"),
        (dict(warmup_steps=1, total_steps=10, min_lr_ratio=-0.1), "min_lr_ratio=-0.1"),
    ],
)
@pytest.mark.parametrize("factory", [warmup_cosine, warmup_linear])
def test_schedules_validate(factory, kwargs, fragment):
    with pytest.raises(ValueError, match="Received") as info:
        factory(make_optimizer(1.0), **kwargs)
    assert fragment in str(info.value)


def test_state_dict_round_trip_resumes_the_same_schedule():
    opt = make_optimizer(1.0)
    sched = warmup_cosine(opt, warmup_steps=3, total_steps=10, min_lr_ratio=0.2)
    lrs_over(opt, sched, 5)
    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)  # the multiplier is an object: saved, and picklable
    expected = lrs_over(opt, sched, 6)

    fresh_opt = make_optimizer(1.0)
    fresh_opt.load_state_dict(opt.state_dict())
    # Built with a different plan: loading the state must bring the saved plan back.
    fresh = warmup_cosine(fresh_opt, warmup_steps=1, total_steps=2)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=False))
    fresh_opt.param_groups[0]["lr"] = fresh.get_last_lr()[0]
    assert fresh.lr_lambdas[0].total_steps == 10
    assert lrs_over(fresh_opt, fresh, 6) == pytest.approx(expected)


def test_multiplier_values_directly():
    f = WarmupDecay(warmup_steps=0, total_steps=4, min_lr_ratio=0.0, shape="cosine")
    assert [f(s) for s in range(5)] == pytest.approx(
        [1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2, 0.0]
    )
    with pytest.raises(ValueError, match="Received: shape='step'"):
        WarmupDecay(warmup_steps=0, total_steps=4, min_lr_ratio=0.0, shape="step")
