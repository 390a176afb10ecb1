"""Dynamic loss scaling for fp16, with one decision shared by every process.

The scale starts at 2**15, doubles after ``growth_interval`` (2000) clean steps and halves
whenever any gradient on ANY process is inf/nan, in which case the step is skipped. The
"found inf" flag is all-reduced (MAX) over the whole job before anyone decides, so every
rank skips, or steps, together, whatever the parallelism (DDP, DTensor shards, or a rank
whose gradients alone overflowed).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from trainmesh._torch.reduce import all_reduce_small


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class DynamicLossScaler:
    """``scale(loss)`` -> backward -> ``unscale_(params)`` -> step unless ``found_inf`` -> ``update(found_inf)``."""

    def __init__(
        self,
        init_scale: float = 2.0**15,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(
                "Loss scaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1. "
                f"Received: init_scale={init_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval}"
            )
        self.scale_value = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide gradients by the scale in place; return whether any process saw inf/nan.

        torch's GradScaler kernel does both in one pass per (device, dtype) group and leaves the
        flag on the device: the host waits once, for the job-wide flag, not once per gradient."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for param in params:
            if param.grad is not None:
                grad = _local(param.grad)
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        flags: dict[torch.device, torch.Tensor] = {}  # one per device: the kernel only ever sets it
        for (device, _dtype), grads in groups.items():
            flag = flags.setdefault(device, torch.zeros(1, dtype=torch.float32, device=device))
            inverse = torch.full((1,), 1.0 / self.scale_value, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inverse)
        found = torch.zeros(1, dtype=torch.float32)
        for flag in flags.values():
            found = torch.maximum(found, flag.cpu())
        return self.any_process(found)

    @staticmethod
    def any_process(flag: torch.Tensor) -> bool:
        return bool(all_reduce_small(flag, op=dist.ReduceOp.MAX).item() > 0)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale_value *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale_value,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale_value = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
