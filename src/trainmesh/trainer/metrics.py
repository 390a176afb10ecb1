"""Metrics whose state is a vector of sums, so a result over N processes is exact.

Each rank updates its metric with its own slice of the batch. The Trainer all-reduces
``metric.state()`` (SUM over the data-parallel group) and calls ``compute(state)``: the
result equals a one-process run over the whole dataset, whatever the per-rank sample
counts. Averaging per-rank results instead would weight a rank holding 2 samples like
one holding 30.

State is float64 on the CPU: counts stay exact up to 2**53 (float32 stops at 2**24,
one epoch of a large dataset), and some accelerators (MPS) have no float64 at all. The
Trainer moves the state to the collective's device for the all-reduce.

>>> import torch
>>> acc = Accuracy()
>>> acc.update(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
>>> acc.state()
tensor([1., 2.], dtype=torch.float64)
>>> acc.compute()
0.5
"""

from __future__ import annotations

import abc

import math

import torch

__all__ = ["Accuracy", "Mean", "Metric", "resolve_metric"]


class Metric(abc.ABC):
    """A streaming metric: ``update`` per batch, ``state`` to reduce, ``compute`` the value.

    Subclasses call ``super().__init__(name, state_size)``, implement ``update`` (adding
    to ``self._state`` with ``self._add``) and ``_compute(state)``, which turns a state
    vector (this rank's, or the SUM over ranks) into a float.

    >>> import torch
    >>> class Total(Metric):
    ...     def __init__(self, name="total"):
    ...         super().__init__(name, state_size=1)
    ...     def update(self, outputs, targets=None):
    ...         self._add(outputs.sum())
    ...     def _compute(self, state):
    ...         return float(state[0])
    >>> total = Total()
    >>> total.update(torch.tensor([1.0, 2.0]))
    >>> total.compute()
    3.0
    """

    name: str

    def __init__(self, name: str, state_size: int) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"A metric name must be a non-empty string. Received: name={name!r}")
        self.name = name
        self._state = torch.zeros(state_size, dtype=torch.float64)

    def reset(self) -> None:
        """Forget everything seen so far (the Trainer calls it at each epoch start)."""
        self._state.zero_()

    @abc.abstractmethod
    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Add one batch (this process's rows) to the state."""

    def state(self) -> torch.Tensor:
        """A copy of the 1-D float64 vector of sums: safe to all-reduce in place."""
        return self._state.clone()

    def compute(self, state: torch.Tensor | None = None) -> float:
        """The metric value from ``state`` (e.g. summed over ranks), or from this rank's own."""
        if state is None:
            return self._compute(self._state)
        state = torch.as_tensor(state).detach()
        if state.shape != self._state.shape:
            raise ValueError(
                f"{type(self).__name__}.compute expects a state of shape {tuple(self._state.shape)}. "
                f"Received: state.shape={tuple(state.shape)}"
            )
        return self._compute(state.to("cpu", torch.float64))

    @abc.abstractmethod
    def _compute(self, state: torch.Tensor) -> float:
        """The value from a state vector (this process's, or the SUM over processes)."""

    def _add(self, *values: torch.Tensor | float) -> None:
        """Add one value to each state slot, in float64 (one device-to-host copy per call)."""
        increment = torch.stack([torch.as_tensor(v).detach().to("cpu", torch.float64).reshape(()) for v in values])
        self._state += increment

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> float:
    # NaN, not Keras's 0.0, when nothing was seen: "no data" must not read as a real score
    # (an EarlyStopping on val_accuracy would otherwise take 0.0 as a measurement).
    if float(denominator) == 0.0:
        return math.nan
    return float(numerator / denominator)


class Mean(Metric):
    """Weighted mean of values: state ``[sum(value * weight), sum(weight)]``.

    ``update(values, *, sample_weight=None)`` (Keras's ``Mean.update_state``): every element
    of ``values`` counts once, or with its broadcast weight. A per-batch mean loss enters with
    ``sample_weight=batch_size`` so that uneven batches and ranks average exactly. The weight
    is keyword-only: a generic ``update(outputs, targets)`` call must fail loudly, not weight
    the outputs by the targets.

    >>> import torch
    >>> m = Mean("loss")
    >>> m.update(torch.tensor(2.0), sample_weight=3)   # a batch of 3 with mean loss 2.0
    >>> m.update(torch.tensor(4.0), sample_weight=1)
    >>> m.compute()
    2.5
    """

    def __init__(self, name: str = "mean") -> None:
        super().__init__(name, state_size=2)

    def update(self, values: torch.Tensor | float, *, sample_weight: torch.Tensor | float | None = None) -> None:
        values = torch.as_tensor(values).detach().to(torch.float64)
        if sample_weight is None:
            self._add(values.sum(), values.numel())
            return
        weights = torch.as_tensor(sample_weight, device=values.device).detach().to(torch.float64)
        try:
            values, weights = torch.broadcast_tensors(values, weights)
        except RuntimeError:
            raise ValueError(
                f"sample_weight must broadcast to the values' shape {tuple(values.shape)}. "
                f"Received: sample_weight.shape={tuple(weights.shape)}"
            ) from None
        self._add((values * weights).sum(), weights.sum())

    def _compute(self, state: torch.Tensor) -> float:
        return _ratio(state[0], state[1])


class Accuracy(Metric):
    """Fraction of correct predictions: state ``[correct, count]``.

    - Class scores ``(..., C)`` with ``C > 1``: the prediction is the argmax over the last
      dim; targets are class ids ``(...)`` or ``(..., 1)``, or one-hot/probabilities
      ``(..., C)`` (compared by their argmax).
    - Binary ``(..., 1)`` or 1-D outputs: the prediction is ``outputs > threshold``; targets
      are 0/1 (or probabilities, read as ``> 0.5``). ``threshold=0.5`` suits probabilities;
      pass ``threshold=0.0`` for logits.

    Every prediction counts once (a ``(B, T, C)`` sequence output counts ``B*T``).

    >>> import torch
    >>> acc = Accuracy()
    >>> acc.update(torch.tensor([[0.2], [0.7], [0.9]]), torch.tensor([0, 0, 1]))
    >>> acc.compute()   # doctest: +ELLIPSIS
    0.666...
    """

    def __init__(self, name: str = "accuracy", *, threshold: float = 0.5) -> None:
        super().__init__(name, state_size=2)
        self.threshold = float(threshold)

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        outputs = torch.as_tensor(outputs).detach()
        targets = torch.as_tensor(targets, device=outputs.device).detach()
        if outputs.dim() == 0:
            raise ValueError("Accuracy needs at least one prediction per sample. Received: outputs.shape=()")
        if outputs.dim() == 1 or outputs.shape[-1] == 1:
            correct = self._binary(outputs, targets)
        else:
            correct = self._categorical(outputs, targets)
        self._add(correct.sum(), correct.numel())

    def _binary(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if outputs.dim() > 1 and targets.shape == outputs.shape[:-1]:
            outputs = outputs.squeeze(-1)
        if targets.shape != outputs.shape:
            raise ValueError(
                f"Binary accuracy needs targets shaped like the outputs {tuple(outputs.shape)}. "
                f"Received: targets.shape={tuple(targets.shape)}"
            )
        return (outputs.float() > self.threshold) == (targets.float() > 0.5)

    def _categorical(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        predicted = outputs.argmax(dim=-1)
        if targets.shape == outputs.shape:
            return predicted == targets.argmax(dim=-1)
        if targets.dim() == outputs.dim() and targets.shape[-1] == 1:
            targets = targets.squeeze(-1)
        if targets.shape != predicted.shape:
            raise ValueError(
                f"Accuracy needs class-id targets of shape {tuple(predicted.shape)} or one-hot targets of shape "
                f"{tuple(outputs.shape)}. Received: targets.shape={tuple(targets.shape)}"
            )
        if targets.is_floating_point():
            # Float labels are fine if they hold whole class ids; 0.7 is a bug, not a class.
            if not torch.equal(targets, targets.round()):
                raise ValueError(
                    "Accuracy needs whole-number class ids as targets. "
                    f"Received: targets with fractional values, e.g. {targets[targets != targets.round()][0].item()}"
                )
            targets = targets.long()
        return predicted == targets

    def _compute(self, state: torch.Tensor) -> float:
        return _ratio(state[0], state[1])

    def __repr__(self) -> str:
        return f"Accuracy(name={self.name!r}, threshold={self.threshold})"


_BY_NAME = {"accuracy": Accuracy, "acc": Accuracy}


def resolve_metric(metric: str | Metric | type) -> Metric:
    """A :class:`Metric` from a name (``"accuracy"``, ``"acc"``), a Metric class, or an instance.

    A name becomes the metric's name, hence its key in the logs (Keras: ``metrics=["acc"]``
    reports ``acc`` and ``val_acc``). Instances are returned as they are.

    >>> resolve_metric("acc")
    Accuracy(name='acc', threshold=0.5)
    """
    if isinstance(metric, Metric):
        return metric
    if isinstance(metric, type) and issubclass(metric, Metric):
        return metric()
    if isinstance(metric, str) and metric in _BY_NAME:
        return _BY_NAME[metric](name=metric)
    raise ValueError(
        f"Unknown metric: expected one of {sorted(_BY_NAME)}, a Metric instance or a Metric class. "
        f"Received: metric={metric!r}"
    )
