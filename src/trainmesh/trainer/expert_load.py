"""Each step's tokens per expert and the load imbalance of a mixture of experts, for the Trainer's log.

Every process counts the (token, expert) pairs it routes in each MoE layer (the dispatch's own
``bincount``, ``_torch/expert_parallel.py``). The global count of a step is the sum over the processes
that hold different tokens, which the Trainer already all-reduces once per step: the loss check
(``loss_tracking.py``). The counts ride in that all-reduce (one rider per layer and expert), so the
figures cost no collective of their own.

Without that check (``nonfinite_loss=None``) there is no per-step collective to ride on: the step's
counts are then summed by one small all-reduce of their own, on the steps the Trainer logs only
(``log_every_n_steps``, and an epoch's last step), so the unchecked mode keeps its point (no per-step
host sync) on every other step. Every process logs the same steps, so they all join it.

Logged per step:

* ``moe_tokens_per_expert``: per MoE layer, the global batch's (token, expert) pairs per expert;
* ``moe_imbalance``: the largest count over the mean count of its layer, the worst layer's. 1.0 is an
  even load; the busiest expert's process sets the pace of the all-to-all, so this is the slowdown
  routing costs over an even split.
"""

from __future__ import annotations

from typing import Any

import torch

from trainmesh import runtime

from trainmesh._torch.reduce import all_reduce_small

from .loss_tracking import add_rider, remove_rider


class _Rider:
    def __init__(self, load: "ExpertLoad", index: int):
        self.load, self.index = load, index

    def local_value(self) -> float:
        if self.index == 0:  # the first rider of the step takes the snapshot the others read
            self.load.take_local()
        return float(self.load.local[self.index])

    def receive(self, total: float) -> None:
        self.load.totals[self.index] = total


class ExpertLoad:
    """Tokens per expert of a model's experts modules, summed over the processes each step."""

    def __init__(self, model: torch.nn.Module, distribution: Any):
        from trainmesh._torch.expert_parallel import dispatch_states

        states = dispatch_states(model) if isinstance(model, torch.nn.Module) else []
        self.states = [state for _, state in states]
        # Under a pipeline a process holds its stage's MoE layers only: every process lays its counts out
        # over all the model's layers (zeros for other stages'), so every process adds the same riders and
        # each layer's sum comes from its own stage's processes (pipeline_experts.expert_layers).
        runner = getattr(model, "_trainmesh_pipeline", None)
        if runner is not None:
            layers = list(runner.expert_layers)
        else:
            layers = [(path, state.num_experts) for path, state in states]
        paths = [path for path, _ in layers]
        self.slots = [paths.index(path) for path, _ in states]
        self.width = layers[0][1] if layers else 0
        self.layers = len(paths)
        self.local = torch.zeros(self.layers * self.width, dtype=torch.float64)
        self.totals = torch.full_like(self.local, float("nan"))
        # processes that route the same tokens (a model axis): each of them adds the same counts
        holders = getattr(distribution, "data_parallel_size", 1) * _sequence_size(distribution)
        pipe = _pipe_size(distribution) if runner is not None else 1
        self.copies = max(runtime.world_size() // max(holders * pipe, 1), 1)
        self.riders = [_Rider(self, i) for i in range(self.local.numel())]
        self.checked = True  # riding on the loss check (start() says)

    def __bool__(self) -> bool:
        return self.layers > 0

    def start(self, checked: bool = True) -> None:
        """``checked``: the Trainer all-reduces the loss every step (``nonfinite_loss`` set); the counts
        ride on it. Otherwise :meth:`step_record` reduces them itself on logged steps."""
        for state in self.states:
            state.train_tokens.zero_()
        self.checked = checked
        if checked:
            for rider in self.riders:
                add_rider(rider)

    def stop(self) -> None:
        for rider in self.riders:
            remove_rider(rider)

    def take_local(self) -> None:
        local = torch.zeros(self.layers, self.width, dtype=torch.float64)
        for slot, state in zip(self.slots, self.states):
            local[slot] = state.train_tokens.double()
            state.train_tokens.zero_()
        self.local = local.view(-1)

    def step_record(self, logged: bool = True) -> dict[str, Any]:
        """The last checked step's figures (empty before one, or without experts). Unchecked, the step's
        own counts, reduced here when ``logged`` (the same on every process); empty otherwise."""
        if self and not self.checked:
            self.take_local()  # this step's counts only: the next step starts from zero
            if not logged:  # not reduced: an earlier logged step's totals are not this step's
                return {}
            self.totals = all_reduce_small(self.local.clone())
        if not self or bool(torch.isnan(self.totals).any()):
            return {}
        counts = (self.totals / self.copies).round().view(self.layers, -1)
        self.totals.fill_(float("nan"))
        mean = counts.mean(dim=1).clamp_min(1e-12)
        return {
            "moe_imbalance": float((counts.max(dim=1).values / mean).max()),
            "moe_tokens_per_expert": [[int(c) for c in layer] for layer in counts.tolist()],
        }


def _pipe_size(distribution: Any) -> int:
    pipeline = getattr(distribution, "pipeline", None)
    mesh = getattr(distribution, "device_mesh", None)
    return mesh.axis_size(pipeline.axis) if pipeline is not None and mesh is not None else 1


def _sequence_size(distribution: Any) -> int:
    sequence = getattr(distribution, "sequence", None)
    mesh = getattr(distribution, "device_mesh", None)
    return mesh.axis_size(sequence.axis) if sequence is not None and mesh is not None else 1
