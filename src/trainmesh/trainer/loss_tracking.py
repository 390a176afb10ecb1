"""The training loss as one process-group-wide number, and the per-step agreement on whether a
step is usable (its loss finite everywhere) and whether anyone asked to stop.

Two modes:

* checked (the default, ``nonfinite_loss`` set): one tiny all-reduce per step, before the
  optimizer step, carries [loss since the last sync, samples, this step's loss and samples (when
  finite here), stop request, non-finite flag]. Every process then takes the same decision
  from the same numbers; a step that was non-finite anywhere is left out of the reported loss.
* unchecked (``nonfinite_loss=None``): loss x samples is summed on the device, with no host sync
  (on the CPU, where reading it costs none, as Python floats), and reduced only every
  ``log_every_n_steps`` steps (with the stop request).

A DTensor loss counts as its global value times this process's rows; processes that share a
data index then contribute equally to numerator and denominator, so the ratio stays exact.

The checked all-reduce is launched as soon as the step's loss is known, before the last
backward (:meth:`LossAccumulator.start_check`), and waited for after it: it then runs beside
backward instead of after it, where its round trip (and any skew between the processes) would
add to every step. Only a check that carries the gradients' norm must wait for backward.

Other per-step agreements can ride on the checked mode's all-reduce instead of making their own
(:func:`add_rider`): the async checkpoint commit asks "is every rank's write done?" this way.
"""

from __future__ import annotations

import math

import torch

from trainmesh._torch.reduce import all_reduce_floats_async, all_reduce_small

# Riders: objects with ``local_value() -> float`` and ``receive(total: float)``, summed over every
# process in the per-step all-reduce. Every process must register the same riders in the same
# order (a Trainer callback's on_train_begin does), or the vectors' lengths would differ.
_RIDERS: list = []


def add_rider(rider) -> None:
    """Sum ``rider.local_value()`` over every process in each checked step's all-reduce and hand
    the total to ``rider.receive()``. Unchecked steps carry nothing: the rider hears nothing."""
    _RIDERS.append(rider)


def remove_rider(rider) -> None:
    if rider in _RIDERS:
        _RIDERS.remove(rider)


class LossAccumulator:
    def __init__(self) -> None:
        self._local_sum: torch.Tensor | float = 0.0  # not reduced yet
        self._local_samples = 0
        self._global_sum = 0.0  # reduced by per-step checks
        self._global_samples = 0.0
        self._step_sum: torch.Tensor | float = 0.0  # the step in progress, this process
        self._step_samples = 0
        self.grad_norm: float | None = None  # of the last checked step, when its gradients rode along
        self._launched = None  # wait() -> the reduced vector: a check in flight (start_check)

    def add(self, loss: torch.Tensor, samples: int) -> None:
        value = loss.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        # On the CPU as a Python float (reading it costs no device sync; the same float64 arithmetic
        # as on a tensor, cheaper per step); on an accelerator summed there, with no host sync.
        value = value.item() if value.device.type == "cpu" else value.double()
        self._step_sum = self._step_sum + value * samples
        self._step_samples += samples

    def discard_step(self) -> None:
        """Forget the step in progress: a fault-tolerant step that did not commit (ft/trainer_hook.py)."""
        self._step_sum, self._step_samples = 0.0, 0

    @property
    def pending(self) -> bool:
        return bool(self._local_samples or self._global_samples or self._step_samples)

    def start_check(self, *, stop_local: bool) -> None:
        """Launch this step's check all-reduce now, with every micro-batch's loss added; :meth:`end_step`
        then only waits for it. Only where reading the loss costs no device sync (the caller knows:
        the Trainer asks on CPU only, on every process alike): on an accelerator the host would stall
        the device's queue before backward, so the check stays after backward there."""
        if self._launched is not None:
            raise RuntimeError("start_check called twice in one step")
        self._launched = all_reduce_floats_async(self._check_vector(stop_local, None))

    def _check_vector(self, stop_local: bool, grad_square: torch.Tensor | None) -> list[float]:
        # Python floats (each value crosses to the host once anyway), summed as one float64 tensor
        # when there are other processes: cheaper per step than stacking a scalar tensor per entry.
        step_value = _host_float(self._step_sum)
        finite = math.isfinite(step_value)
        return [
            _host_float(self._local_sum),
            float(self._local_samples),
            step_value if finite else 0.0,
            float(self._step_samples if finite else 0),
            1.0 if stop_local else 0.0,
            0.0 if finite else 1.0,
            *(float(rider.local_value()) for rider in _RIDERS),
            *([float(grad_square.detach().double().cpu())] if grad_square is not None else []),
        ]

    def end_step(self, *, check: bool, stop_local: bool, grad_square: torch.Tensor | None = None) -> tuple[bool, bool]:
        """Fold the step in. Returns ``(non-finite on some process, stop requested somewhere)``,
        both identical on every process when ``check`` (unchecked: ``(False, False)``).

        ``grad_square`` (this process's share of the squared gradient norm, checked mode only, given
        by every process or by none) rides in the same all-reduce; ``grad_norm`` is then the global
        norm (None otherwise): gradient clipping needs no all-reduce of its own. A check launched
        early (:meth:`start_check`) is waited for here; it cannot carry ``grad_square``."""
        launched, self._launched = self._launched, None
        self.grad_norm = None
        if launched is not None and (not check or grad_square is not None):
            raise RuntimeError("a check launched by start_check must end in a checked end_step without grad_square")
        if not check:
            self._local_sum = self._local_sum + self._step_sum
            self._local_samples += self._step_samples
            self._step_sum, self._step_samples = 0.0, 0
            return False, False
        if launched is None:
            launched = all_reduce_floats_async(self._check_vector(stop_local, grad_square))
        reduced = list(launched())  # (a copy: the no-op reduction of one process hands back its input)
        self._step_sum, self._step_samples = 0.0, 0
        if grad_square is not None:
            self.grad_norm = math.sqrt(max(reduced.pop(), 0.0))
        for rider, total in zip(_RIDERS, reduced[6:]):
            rider.receive(total)
        self._local_sum, self._local_samples = 0.0, 0
        nonfinite = reduced[5] > 0
        self._global_sum += reduced[0] + (0.0 if nonfinite else reduced[2])
        self._global_samples += reduced[1] + (0.0 if nonfinite else reduced[3])
        return nonfinite, reduced[4] > 0

    def sync(self, stop_local: bool) -> tuple[float, float, bool]:
        """``(mean loss, samples, anyone asked to stop)`` over every process since the last sync."""
        if not self._local_samples:  # checked mode: every step was reduced (and the stop agreed) already
            samples = self._global_samples
            mean = self._global_sum / samples if samples else math.nan
            self._global_sum, self._global_samples = 0.0, 0.0
            return mean, samples, False
        reduced = all_reduce_small(
            torch.stack([_to_cpu_double(self._local_sum), _f64(self._local_samples), _f64(1.0 if stop_local else 0.0)])
        ).tolist()
        total = self._global_sum + reduced[0]
        samples = self._global_samples + reduced[1]
        self._local_sum, self._local_samples, self._global_sum, self._global_samples = 0.0, 0, 0.0, 0.0
        return (total / samples if samples else math.nan), samples, reduced[2] > 0


def _host_float(value: torch.Tensor | float) -> float:
    """A float64 sum (a 0-d tensor on any device, or a float) as a Python float: one read."""
    return value.item() if torch.is_tensor(value) else float(value)


def _f64(value: float) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float64)


def _to_cpu_double(value: torch.Tensor | float) -> torch.Tensor:
    if torch.is_tensor(value):
        return value.detach().double().cpu().reshape(())
    return _f64(value)
