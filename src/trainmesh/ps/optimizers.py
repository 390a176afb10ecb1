"""Server-side optimizers: SGD (momentum, Nesterov), Adam, AdamW and Adagrad built from a JSON spec.

A server applies each pushed gradient to one shard as it arrives. Dense parts (1-D) follow
``torch.optim.SGD/Adam/AdamW/Adagrad`` exactly. Row updates (2-D tables) touch only the given rows and
their state; duplicate rows in one push are summed first. Every row keeps its own step count,
so a row's bias correction (Adam) and ``lr_decay`` (Adagrad) depend only on how often that row
was updated, never on how the table is split into shards. For Adam rows this is the update of
``torch.optim.SparseAdam`` applied to each row as its own parameter (the same as SparseAdam on
the whole table whenever every touched row is touched at every step); weight decay, which
SparseAdam lacks, is applied lazily to the touched rows.

State is a ``dict[str, Tensor]`` owned by the caller (the ``Shard``), so it travels in snapshots
and between servers with the value. ``step`` has shape ``value.shape[:-1]``: a scalar for a
dense part, one count per row for a table.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["ServerOptimizer", "make_optimizer", "OPTIMIZER_DEFAULTS"]

# name -> {key: default}; None marks a required key.
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": None, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False, "dampening": 0.0},
    "adam": {"lr": None, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"lr": None, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},  # decoupled decay
    "adagrad": {"lr": None, "eps": 1e-10, "initial_accumulator_value": 0.0, "lr_decay": 0.0, "weight_decay": 0.0},
}


def _number(
    spec_name: str, key: str, value: Any, *, low: float = 0.0, high: float | None = None, open_high: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{spec_name} optimizer: {key} must be a finite number, got {value!r}")
    value = float(value)
    too_high = high is not None and (value >= high if open_high else value > high)
    if value < low or too_high:
        bound = f"[{low}, {high}{')' if open_high else ']'}" if high is not None else f">= {low}"
        raise ValueError(f"{spec_name} optimizer: {key} must be in {bound}, got {value!r}")
    return value


def _normalize(spec: Any) -> dict[str, Any]:
    """Validate ``spec`` and fill defaults; the result is JSON-able (betas become a list)."""
    if not isinstance(spec, dict):
        raise TypeError(f"optimizer spec must be a dict, got {type(spec).__name__}: {spec!r}")
    name = spec.get("name")
    if name not in OPTIMIZER_DEFAULTS:
        raise ValueError(f"unknown optimizer name {name!r}; expected one of {sorted(OPTIMIZER_DEFAULTS)}")
    defaults = OPTIMIZER_DEFAULTS[name]
    unknown = sorted(set(spec) - set(defaults) - {"name"})
    if unknown:
        raise ValueError(f"{name} optimizer: unknown keys {unknown}; allowed: {sorted(defaults)}")
    missing = sorted(k for k, v in defaults.items() if v is None and k not in spec)
    if missing:
        raise ValueError(f"{name} optimizer: missing required keys {missing} in {spec!r}")
    out: dict[str, Any] = {"name": name}
    for key, default in defaults.items():
        value = spec.get(key, default)
        if key == "nesterov":
            if not isinstance(value, bool):
                raise ValueError(f"sgd optimizer: nesterov must be a bool, got {value!r}")
            out[key] = value
        elif key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise ValueError(f"adam optimizer: betas must be a pair of numbers, got {value!r}")
            out[key] = [
                _number(name, "betas[0]", value[0], high=1.0, open_high=True),
                _number(name, "betas[1]", value[1], high=1.0, open_high=True),
            ]
        elif key in ("momentum", "dampening"):
            out[key] = _number(name, key, value, high=1.0)
        else:
            out[key] = _number(name, key, value)
    if name == "sgd" and out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
        raise ValueError(
            "sgd optimizer: nesterov requires momentum > 0 and dampening == 0, "
            f"got momentum={out['momentum']}, dampening={out['dampening']}"
        )
    return out


def make_optimizer(spec: dict) -> "ServerOptimizer":
    """Build a ``ServerOptimizer`` from e.g. ``{"name": "adam", "lr": 1e-3}``."""
    return ServerOptimizer(spec)


class ServerOptimizer:
    """One optimizer configuration; stateless itself (state lives with each shard)."""

    def __init__(self, spec: dict):
        self.spec = _normalize(spec)
        self.name: str = self.spec["name"]

    def __repr__(self) -> str:
        return f"ServerOptimizer({self.spec!r})"

    # -- state -------------------------------------------------------------------------

    def state_keys(self) -> tuple[str, ...]:
        if self.name == "sgd":
            return ("step", "momentum_buffer") if self.spec["momentum"] != 0 else ("step",)
        if self.name in ("adam", "adamw"):
            return ("step", "exp_avg", "exp_avg_sq")
        return ("step", "sum")

    def init_state(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh state for ``value`` (1-D dense part or 2-D table)."""
        _check_value(value)
        state = {"step": torch.zeros(value.shape[:-1], dtype=torch.int64)}
        if self.name == "sgd" and self.spec["momentum"] != 0:
            state["momentum_buffer"] = torch.zeros_like(value)
        elif self.name in ("adam", "adamw"):
            state["exp_avg"] = torch.zeros_like(value)
            state["exp_avg_sq"] = torch.zeros_like(value)
        elif self.name == "adagrad":
            state["sum"] = torch.full_like(value, self.spec["initial_accumulator_value"])
        return state

    # -- updates -----------------------------------------------------------------------

    def step(
        self, value: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float | None = None
    ) -> None:
        """Update a dense 1-D part in place."""
        _check_value(value, dims=1)
        if not isinstance(grad, torch.Tensor) or grad.shape != value.shape:
            raise ValueError(f"gradient shape {_shape(grad)} does not match value shape {tuple(value.shape)}")
        lr = self._lr(lr)
        state["step"] += 1
        if grad.dtype != value.dtype:
            grad = grad.to(value.dtype)
        if self.name == "sgd":
            # Only momentum reads the step (its first one starts the buffer): plain SGD skips
            # reading the counter back, one tensor-to-Python sync per push fewer.
            first = self.spec["momentum"] != 0 and int(state["step"]) == 1
            self._sgd(value, grad, state, lr, first=first)
            return
        step = int(state["step"])
        if self.name in ("adam", "adamw"):
            self._adam_dense(value, grad, state, lr, step)
        else:
            self._adagrad(value, grad, state, lr, step)

    def step_rows(
        self,
        value: torch.Tensor,
        local_rows: torch.Tensor,
        grads: torch.Tensor,
        state: dict[str, torch.Tensor],
        lr: float | None = None,
        *,
        unique_rows: bool = False,
    ) -> None:
        """Update rows ``local_rows`` of the 2-D ``value`` (and their state) in place.
        ``unique_rows``: the caller vouches that no row appears twice and that every row is in
        range (the server's row store passes the ids of a push once summed and checked), so they
        need no summing and no bounds check here."""
        _check_value(value, dims=2)
        rows, dim = value.shape
        if not isinstance(local_rows, torch.Tensor) or local_rows.dtype != torch.int64 or local_rows.dim() != 1:
            raise ValueError(f"local_rows must be a 1-D int64 tensor, got {_describe(local_rows)}")
        if not isinstance(grads, torch.Tensor) or grads.shape != (local_rows.numel(), dim):
            raise ValueError(f"row gradients must have shape {(local_rows.numel(), dim)}, got {_shape(grads)}")
        if not unique_rows and local_rows.numel() and (int(local_rows.min()) < 0 or int(local_rows.max()) >= rows):
            bad = local_rows[(local_rows < 0) | (local_rows >= rows)][0]
            raise ValueError(f"local row {int(bad)} out of range for a shard of {rows} rows")
        lr = self._lr(lr)
        if local_rows.numel() == 0:
            return
        if unique_rows and self.name == "sgd" and self.spec["momentum"] == 0 and self.spec["weight_decay"] == 0:
            # Plain SGD is value += -lr * grad per row: updated in place by index, without the
            # gather, the copies of the rows and the scatter back (the same arithmetic as
            # ``add_(grad, alpha=-lr)`` on the gathered rows, so the same bits).
            value.index_add_(0, local_rows, grads.to(value.dtype), alpha=-lr)
            state["step"].index_add_(0, local_rows, torch.ones_like(local_rows))
            return
        # The update is non-linear in the gradient, so a row pushed twice gets the sum once.
        unique, inverse = torch.unique(local_rows, return_inverse=True)
        grad = torch.zeros(unique.numel(), dim, dtype=value.dtype).index_add_(0, inverse, grads.to(value.dtype))
        # Work on gathered copies of the touched rows, then scatter them back.
        rows_value = value[unique]
        rows_state = {k: v[unique] for k, v in state.items()}
        rows_state["step"] += 1
        steps = rows_state["step"]
        if self.name == "sgd":
            self._sgd(rows_value, grad, rows_state, lr, first=(steps == 1).unsqueeze(1))
        elif self.name in ("adam", "adamw"):
            self._adam_rows(rows_value, grad, rows_state, lr, steps)
        else:
            self._adagrad(rows_value, grad, rows_state, lr, steps.to(torch.float64).unsqueeze(1))
        value[unique] = rows_value
        for key, tensor in rows_state.items():
            state[key][unique] = tensor

    def _lr(self, lr: float | None) -> float:
        if lr is None:
            return self.spec["lr"]
        return _number(self.name, "lr override", lr)

    # -- the algorithms; the formulas and operation order follow torch.optim ------------------

    def _sgd(self, value, grad, state, lr, first) -> None:
        spec = self.spec
        if spec["weight_decay"] != 0:
            grad = grad.add(value, alpha=spec["weight_decay"])
        if spec["momentum"] != 0:
            buf = state["momentum_buffer"]
            momentum = spec["momentum"]
            # torch starts the buffer as a copy of the first gradient (no dampening), then
            # buf = momentum * buf + (1 - dampening) * grad. ``first`` is per row for tables.
            updated = buf.mul(momentum).add_(grad, alpha=1 - spec["dampening"])
            if isinstance(first, bool):
                buf.copy_(grad if first else updated)
            else:
                buf.copy_(torch.where(first, grad, updated))
            grad = grad.add(buf, alpha=momentum) if spec["nesterov"] else buf
        value.add_(grad, alpha=-lr)

    def _decay(self, value, grad, lr):
        """Adam's L2 term joins the gradient; AdamW's decays the value itself (decoupled)."""
        if self.spec["weight_decay"] == 0:
            return grad
        if self.name == "adamw":
            value.mul_(1 - lr * self.spec["weight_decay"])
            return grad
        return grad.add(value, alpha=self.spec["weight_decay"])

    def _adam_dense(self, value, grad, state, lr, step: int) -> None:
        beta1, beta2 = self.spec["betas"]
        grad = self._decay(value, grad, lr)
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(self.spec["eps"])
        value.addcdiv_(state["exp_avg"], denom, value=-lr / bias_correction1)

    def _adam_rows(self, value, grad, state, lr, steps: torch.Tensor) -> None:
        # torch.optim.SparseAdam's arithmetic, with a bias correction per row.
        beta1, beta2 = self.spec["betas"]
        grad = self._decay(value, grad, lr)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.add_(grad.sub(exp_avg).mul_(1 - beta1))
        exp_avg_sq.add_(grad.pow(2).sub_(exp_avg_sq).mul_(1 - beta2))
        denom = exp_avg_sq.sqrt().add_(self.spec["eps"])
        steps_f = steps.to(torch.float64)
        step_size = lr * torch.sqrt(1 - beta2**steps_f) / (1 - beta1**steps_f)
        value.add_(-step_size.to(value.dtype).unsqueeze(1) * exp_avg.div(denom))

    def _adagrad(self, value, grad, state, lr, step) -> None:
        # ``step`` is an int for a dense part, a (rows, 1) tensor for table rows.
        spec = self.spec
        if spec["weight_decay"] != 0:
            grad = grad.add(value, alpha=spec["weight_decay"])
        clr = lr / (1 + (step - 1) * spec["lr_decay"])
        state["sum"].addcmul_(grad, grad, value=1)
        std = state["sum"].sqrt().add_(spec["eps"])
        if isinstance(clr, torch.Tensor):
            value.sub_(clr.to(value.dtype) * grad / std)
        else:
            value.addcdiv_(grad, std, value=-clr)


def _check_value(value: Any, dims: int | None = None) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"optimizer value must be a floating-point tensor, got {_describe(value)}")
    if value.dim() not in (1, 2) or (dims is not None and value.dim() != dims):
        want = f"{dims}-D" if dims is not None else "1-D (dense part) or 2-D (table)"
        raise ValueError(f"optimizer value must be {want}, got shape {tuple(value.shape)}")


def _shape(x: Any) -> Any:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {x.dtype} and shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"
