"""The worker's optimizer under ``ParameterServerStrategy``: ``step()`` ships gradients to the
servers instead of updating locally.

``server_optimizer_spec`` turns the user's torch optimizer (class and per-group
hyperparameters) into the servers' optimizer config, so ``torch.optim.SGD(..., momentum=0.9)``
means SGD with momentum 0.9 on the servers (SGD, Adam, AdamW, Adagrad). ``PSOptimizer`` is a real ``torch.optim.Optimizer``
over the same parameter groups (LR schedulers, the Trainer's ``zero_grad`` and ``param_groups``
work unchanged); its ``step()`` pushes, clocks and pulls, pipelined. When no served parameter is
sync, it waits for none of them: pushes and clocks stay in flight (at most staleness + 1 steps)
and the parameters come from the bounded-staleness copy of ``dense_cache.py``.
"""

from __future__ import annotations

import collections
import math
from concurrent.futures import Future
from typing import Any, Callable

import torch


SUPPORTED = ("SGD", "Adam", "AdamW", "Adagrad")


def server_optimizer_spec(optimizer: torch.optim.Optimizer, group: dict, num_workers: int = 1) -> dict[str, Any]:
    """The servers' optimizer config mirroring ``optimizer``'s class and ``group``'s hyperparameters.

    ``weight_decay`` is divided by ``num_workers``: the value for a parameter updated at every
    worker's push (async, SSP), so a round of N pushes decays about once; a sync parameter is
    updated once per round (``sync_rounds.py``) and takes it whole (``num_workers=1``)."""
    kind = type(optimizer).__name__
    if kind not in SUPPORTED or not isinstance(optimizer, getattr(torch.optim, kind)):
        raise ValueError(
            f"ParameterServerStrategy mirrors torch.optim.SGD, Adam, AdamW and Adagrad on the servers. "
            f"Received: optimizer class {type(optimizer).__module__}.{type(optimizer).__qualname__}"
        )
    _refuse(group, kind, maximize=False, foreach=None, differentiable=False, capturable=False, fused=None)
    lr = float(group["lr"])
    weight_decay = float(group.get("weight_decay", 0.0)) / num_workers
    if kind == "SGD":
        return {
            "name": "sgd",
            "lr": lr,
            "momentum": float(group.get("momentum", 0.0)),
            "dampening": float(group.get("dampening", 0.0)),
            "weight_decay": weight_decay,
            "nesterov": bool(group.get("nesterov", False)),
        }
    if kind in ("Adam", "AdamW"):
        _refuse(group, kind, amsgrad=False)
        decoupled = kind == "AdamW" or bool(group.get("decoupled_weight_decay", False))
        return {
            "name": "adamw" if decoupled else "adam",
            "lr": lr,
            "betas": [float(b) for b in group["betas"]],
            "eps": float(group["eps"]),
            "weight_decay": weight_decay,
        }
    _refuse(group, kind, lr_decay=0)  # torch counts steps per worker; the servers count pushes
    return {
        "name": "adagrad",
        "lr": lr,
        "eps": float(group["eps"]),
        "weight_decay": weight_decay,
        "initial_accumulator_value": float(group.get("initial_accumulator_value", 0.0)),
    }


def spec_for_mode(spec: dict[str, Any], mode: str, num_workers: int) -> dict[str, Any]:
    """``spec`` (from ``server_optimizer_spec``) for a parameter of ``mode``: weight decay whole
    for a sync one (applied once per round), divided by the workers for the others."""
    if mode == "sync" or not spec.get("weight_decay"):
        return spec
    return {**spec, "weight_decay": spec["weight_decay"] / num_workers}


def _refuse(group: dict, kind: str, **supported: Any) -> None:
    """Options the servers do not implement must keep their default, or we say so."""
    for option, default in supported.items():
        if option in group and group[option] not in (default, None) and group[option] != default:
            raise ValueError(
                f"{kind}({option}={group[option]!r}) is not supported by the parameter servers "
                f"(only {option}={default!r}). Received: {option}={group[option]!r}"
            )


class PSOptimizer(torch.optim.Optimizer):
    """Push gradients with the current lr, ``clock()``, pull fresh values (see module docstring).
    ``flush()`` waits for the steps still in flight (SSP/async)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, strategy: Any, groups: list[tuple[dict, list[str]]], tables: list
    ):
        # Own copies of the user's groups (same params and hyperparameters): a scheduler moves
        # this optimizer's lr, and step() sends it with every push.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.inner_class = type(optimizer).__name__
        self._strategy = strategy
        self._names = [names for _, names in groups]
        self._tables = tables
        self.scale = 1.0 / strategy.num_workers  # the gradient convention
        # Steps whose pushes and clock are still in flight (SSP/async). staleness + 1 of them keep
        # memory bounded; more could not be used anyway: a worker whose own clock lags on the
        # servers by more than s must wait for its own pushes before its copy is fresh enough.
        self._in_flight: collections.deque[list[Future]] = collections.deque()
        cache = strategy.dense_cache
        self.max_in_flight = 2 if cache is None or math.isinf(cache.staleness) else int(cache.staleness) + 1

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        client = self._strategy.client
        # No barrier among workers: a sync parameter's pushes wait on the servers for their round
        # (sync_rounds.py), so a peer's next push cannot reach a pull of this round, however late.
        futures = []
        for group, names in zip(self.param_groups, self._names):
            grads = {}
            for name in names:
                param = self._strategy._dense[name]
                if param.grad is not None:
                    grads[name] = (param.grad * self.scale).contiguous()
            if grads:
                futures.append(client.push(grads, lr=float(group["lr"])))
        table_lr = float(self.param_groups[0]["lr"]) if self.param_groups else None
        for table in self._tables:
            future = table.push_gradients(scale=self.scale, lr=table_lr)
            if future is not None:
                futures.append(future)
        # Pipelined: push, clock and pull leave back to back (one round trip, not three). The
        # servers order the clock and the pull after this worker's pushes (``after_pushes``).
        clocked = client.clock(wait_for_pushes=False)
        if self._strategy.dense_cache is None:  # a sync parameter: wait for everything, every step
            self._strategy.pull_dense()
            for future in [*futures, clocked]:
                future.result()  # surfaces a refused push
            return loss
        # SSP/async: leave the step's pushes and clock in flight (their errors surface within
        # max_in_flight steps) and read the bounded-staleness copy, pulled only when too old.
        self._in_flight.append([*futures, clocked])
        self._reap(self.max_in_flight)
        self._strategy.refresh_dense()
        return loss

    def _reap(self, limit: int) -> None:
        """Resolve finished steps in order and wait for the oldest while more than ``limit`` are in flight."""
        while self._in_flight and (len(self._in_flight) > limit or all(f.done() for f in self._in_flight[0])):
            for future in self._in_flight.popleft():
                future.result()  # raises a refused push or a timed-out clock

    def flush(self, raise_errors: bool = True) -> None:
        """Wait for every step still in flight and a prefetch (SSP/async); ``close()`` calls it."""
        try:
            self._reap(0)
            if self._strategy.dense_cache is not None:
                self._strategy.dense_cache.drain()
        except Exception:
            self._in_flight.clear()
            if raise_errors:
                raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for table in self._tables:
            table.zero_grad_rows()
