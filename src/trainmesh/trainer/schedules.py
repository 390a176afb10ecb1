"""Learning-rate scaling for the global batch, and warmup-then-decay schedules.

Step convention: a ``LambdaLR`` multiplies each base lr by ``f(s)``, where ``s`` is the
number of optimizer steps already taken (the Trainer steps the scheduler once per
optimizer step). So ``f(0)`` is the lr of the first step.

- Warmup, ``s < warmup_steps``: ``f(s) = (s + 1) / warmup_steps``. It starts at
  ``1 / warmup_steps``, not 0, so the first step is not wasted at lr 0, and the last
  warmup step runs at the full lr.
- Decay, ``warmup_steps <= s <= total_steps``: from 1 down to ``min_lr_ratio``, cosine or
  linear in ``(s - warmup_steps) / (total_steps - warmup_steps)``. The first decay step
  also runs at the full lr; ``min_lr_ratio`` is reached once ``total_steps`` steps are done.
- After ``total_steps``: constant ``min_lr_ratio`` (training longer than planned is not an error).

>>> import torch
>>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
>>> sched = warmup_cosine(opt, warmup_steps=2, total_steps=4)
>>> lrs = []
>>> for _ in range(5):
...     lrs.append(round(opt.param_groups[0]["lr"], 6)); opt.step(); sched.step()
>>> lrs
[0.05, 0.1, 0.1, 0.05, 0.0]
"""

from __future__ import annotations

import math
import numbers

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["scale_lr", "warmup_cosine", "warmup_linear"]

_RULES = ("linear", "sqrt")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}")
    return int(value)


def scale_lr(base_lr: float, global_batch: int, base_batch: int, rule: str = "linear") -> float:
    """The lr for ``global_batch`` given one tuned for ``base_batch`` (Goyal et al. 2017).

    ``"linear"``: ``base_lr * global_batch / base_batch`` (SGD); ``"sqrt"``:
    ``base_lr * sqrt(global_batch / base_batch)`` (often better for Adam-style optimizers).

    >>> scale_lr(0.1, global_batch=1024, base_batch=256)
    0.4
    >>> scale_lr(0.1, global_batch=1024, base_batch=256, rule="sqrt")
    0.2
    """
    if rule not in _RULES:
        raise ValueError(f"rule must be one of {_RULES}. Received: rule={rule!r}")
    if (
        isinstance(base_lr, bool)
        or not isinstance(base_lr, numbers.Real)
        or not (math.isfinite(base_lr) and base_lr > 0)
    ):
        raise ValueError(f"base_lr must be a positive finite number. Received: base_lr={base_lr!r}")
    ratio = _positive_int("global_batch", global_batch) / _positive_int("base_batch", base_batch)
    return float(base_lr) * (ratio if rule == "linear" else math.sqrt(ratio))


class WarmupDecay:
    """The multiplier ``f(s)`` of :func:`warmup_cosine` / :func:`warmup_linear`.

    A callable object, not a closure: ``LambdaLR.state_dict()`` saves an object's fields
    (and skips plain functions), so checkpoints carry the schedule and pickle cleanly.

    >>> f = WarmupDecay(warmup_steps=2, total_steps=4, min_lr_ratio=0.0, shape="linear")
    >>> [f(s) for s in range(6)]
    [0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    """

    def __init__(self, *, warmup_steps: int, total_steps: int, min_lr_ratio: float, shape: str) -> None:
        if shape not in ("cosine", "linear"):
            raise ValueError(f"shape must be 'cosine' or 'linear'. Received: shape={shape!r}")
        total_steps = _positive_int("total_steps", total_steps)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer. Received: warmup_steps={warmup_steps!r}")
        if warmup_steps > total_steps:
            raise ValueError(
                f"warmup_steps must be <= total_steps ({total_steps}). Received: warmup_steps={warmup_steps!r}"
            )
        if (
            isinstance(min_lr_ratio, bool)
            or not isinstance(min_lr_ratio, numbers.Real)
            or not 0.0 <= min_lr_ratio <= 1.0
        ):
            raise ValueError(f"min_lr_ratio must be in [0, 1]. Received: min_lr_ratio={min_lr_ratio!r}")
        self.warmup_steps = int(warmup_steps)
        self.total_steps = total_steps
        self.min_lr_ratio = float(min_lr_ratio)
        self.shape = shape

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step >= self.total_steps:
            return self.min_lr_ratio
        # Here warmup_steps <= step < total_steps, so the denominator is >= 1.
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        if self.shape == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay

    def __repr__(self) -> str:
        return (
            f"WarmupDecay(warmup_steps={self.warmup_steps}, total_steps={self.total_steps}, "
            f"min_lr_ratio={self.min_lr_ratio}, shape={self.shape!r})"
        )


def warmup_cosine(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``.

    ``TrainerConfig(scheduler=...)`` wants a callable ``optimizer -> scheduler``:

    >>> import functools
    >>> make = functools.partial(warmup_cosine, warmup_steps=100, total_steps=1000, min_lr_ratio=0.1)
    """
    return LambdaLR(
        optimizer,
        WarmupDecay(warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio, shape="cosine"),
    )


def warmup_linear(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup over ``warmup_steps``, then linear decay to ``min_lr_ratio * lr`` at ``total_steps``.

    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = warmup_linear(opt, warmup_steps=0, total_steps=4, min_lr_ratio=0.5)
    >>> [sched.lr_lambdas[0](s) for s in range(5)]
    [1.0, 0.875, 0.75, 0.625, 0.5]
    """
    return LambdaLR(
        optimizer,
        WarmupDecay(warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio, shape="linear"),
    )
