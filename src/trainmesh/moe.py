"""Mixtures of experts under trainmesh: what a training script may call beside the layout.

Expert parallelism itself needs no call: lay the experts out (``LayoutMap.auto(model, mesh,
expert_axis="data")`` or explicit ``("data", None, None)`` entries) and distribute the model as any other.
Here are the extras:

* :func:`load_balancing_loss`: transformers' auxiliary loss over the global batch (one process's value);
* :func:`dispatch_stats` / :func:`reset_dispatch_stats`: per experts module, the collectives run, the bytes
  sent to other processes and the tokens each expert received from this process;
* :class:`RouterBiasBalancing`: DeepSeek-V3's bias balancing, updated from the global batch's expert loads
  (the same bias on every process).

>>> from trainmesh.moe import load_balancing_loss   # doctest: +SKIP
"""

from ._torch.expert_parallel import dispatch_stats, reset_dispatch_stats
from ._torch.moe_balance import load_balancing_loss
from .trainer.router_bias import RouterBiasBalancing

__all__ = ["RouterBiasBalancing", "dispatch_stats", "load_balancing_loss", "reset_dispatch_stats"]
