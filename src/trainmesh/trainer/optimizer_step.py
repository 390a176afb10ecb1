"""One optimizer step of the Trainer: forward/backward over its micro-batches, the non-finite loss check,
gradient clipping, the optimizer and scheduler step, and the step's record.

A mixin of :class:`~trainmesh.trainer.Trainer`: the gradients come from ``step.forward_backward``; the
loss all-reduce (which also carries stop requests and, where it can, the gradient norm) from
``loss_tracking.py``; a step a fault-tolerant replica group does not commit returns None.
"""

from __future__ import annotations

import sys
from typing import Any

from .loss_tracking import LossAccumulator
from .step import clip_gradients_, forward_backward, global_grad_norm, local_grad_square_sum


class OptimizerStep:
    def _optimizer_step(self, micro_batches: list, losses: LossAccumulator) -> dict[str, Any] | None:
        guard = self.config.nonfinite_loss
        scaler = self.precision.scaler
        # Without a loss scaler the gradients are final after backward: their norm rides on the loss
        # check's all-reduce (one collective per step instead of two). A scaler unscales them first, below.
        ft = self._ft  # replica groups: the gradients change (cross-group average) after backward
        ride = guard is not None and scaler is None and self.config.max_grad_norm is not None and ft is None
        # Otherwise the check needs only the losses: on CPU it starts before the last backward and runs
        # beside it (loss_tracking.py); on an accelerator reading the loss early would stall the device.
        early = guard is not None and not ride and self._device_type == "cpu" and ft is None
        self._beacon.phase = "forward/backward and gradient reduction"
        on_outputs = self._update_metrics if ft is None else ft.defer(self._update_metrics)
        forward_backward(
            self.model,
            micro_batches if ft is None else ft.share(micro_batches),
            self.loss_fn,
            self.precision,
            losses,
            on_outputs=on_outputs if self.metrics else None,
            before_last_backward=(lambda: losses.start_check(stop_local=self._stop_local)) if early else None,
        )
        if ft is not None and not ft.commit():  # should_commit gates all that follows
            losses.discard_step()
            return None
        self._beacon.phase = "loss all-reduce (non-finite check, stop request)"
        nonfinite, stop = losses.end_step(
            check=guard is not None,
            stop_local=self._stop_local,
            grad_square=local_grad_square_sum(self.params) if ride else None,
        )
        self.stop_requested = self.stop_requested or stop
        if nonfinite and scaler is None:
            return self._nonfinite_step(guard)
        # Under fp16 a non-finite loss is an overflow like any other: the scaler skips and backs off.
        found_inf = nonfinite or (scaler.unscale_(self.params) if scaler is not None else False)
        grad_norm = None
        self._beacon.phase = "gradient clipping and optimizer step"
        if self.config.max_grad_norm is not None and not found_inf:
            grad_norm = losses.grad_norm if ride else global_grad_norm(self.params)
            clip_gradients_(self.params, self.config.max_grad_norm, grad_norm)
        if not found_inf:
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update(found_inf)
        self.global_step += 1
        record: dict[str, Any] = {
            "global_step": self.global_step,
            "lr": self.optimizer.param_groups[0]["lr"],
            "skipped": bool(found_inf),
        }
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        if scaler is not None:
            record["loss_scale"] = scaler.scale_value
        return record

    def _nonfinite_step(self, policy: str) -> dict[str, Any]:
        """A non-finite loss somewhere: every process takes the same branch (the flag was all-reduced)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_steps += 1
        self.global_step += 1
        if policy == "stop":
            self.request_stop(f"non-finite loss at step {self.global_step}")
            self.stop_requested = True
        elif policy == "rollback":
            self._rollback()
        if self.is_main_process and self.nonfinite_steps <= 5:
            print(f"[trainmesh] non-finite loss at step {self.global_step}: {policy}", file=sys.stderr, flush=True)
        return {
            "global_step": self.global_step,
            "lr": self.optimizer.param_groups[0]["lr"],
            "skipped": True,
            "nonfinite": True,
        }
