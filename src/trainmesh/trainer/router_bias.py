"""DeepSeek-V3's bias balancing ("auxiliary-loss-free load balancing") over the global batch.

DeepSeek-V3's router picks its top-k experts on ``sigmoid(logits) + e_score_correction_bias`` (the bias
changes the choice only, not the routing weights). Between steps the bias of each expert moves by a fixed
``rate`` towards balance: ``bias += rate * sign(mean_load - load_e)``, where ``load_e`` is the number of
(token, expert) pairs the step routed to expert ``e``. transformers' model carries the bias as a buffer but
never updates it; this class does.

Why the counts are all-reduced: under data or expert parallelism each process routes only its slice of
the batch, so its own counts would move its bias differently from the other processes' (the routers would
drift apart, and with them the routing of the same token on different processes). One all-reduce of the
step's counts over the batch axis (``layers x num_experts`` integers) gives every process the global
batch's loads, hence the same update as one process on the whole batch, bit for bit (integer counts).

Under ``tm.Trainer`` it is a callback (``callbacks=[RouterBiasBalancing(rate=1e-3)]``, the model and the
distribution taken from the trainer), as torchtitan's ``load_balance_coeff`` and Megatron's
``moe_router_enable_expert_bias`` update it without a call in the loop: once per optimizer step, after
the step was applied, from the counts of all of the step's micro-batches. A step the Trainer skipped
(``skipped`` in its record: a loss scaler's overflow, a non-finite loss) leaves the bias as it was, as
the parameters; evaluate and predict forwards (no grad) are never counted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.trainer.callbacks import Callback

_BIAS = "e_score_correction_bias"


class RouterBiasBalancing(Callback):
    """Counts the experts each bias-corrected router chose in training forwards, and on :meth:`step`
    updates every router's ``e_score_correction_bias`` from the global batch's counts.

    ``model``: plain or distributed (hooks go on its router modules; FSDP2 and expert parallelism keep those
    modules); as a Trainer callback, default the trainer's. ``rate``: DeepSeek-V3's bias update speed
    (``gamma``; 1e-3 in its paper). ``distribution``: default the trainer's as a callback, else the current
    one; without one, or on one process, the counts are this process's.

    >>> trainer = tm.Trainer(model, opt, loss, callbacks=[RouterBiasBalancing(rate=1e-3)])  # doctest: +SKIP
    >>> balancing = RouterBiasBalancing(model, rate=1e-3)  # a hand-written loop  # doctest: +SKIP
    >>> loss.backward(); opt.step(); balancing.step()              # doctest: +SKIP
    """

    def __init__(self, model: nn.Module | None = None, rate: float = 1e-3, *, distribution=None):
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
            raise ValueError(f"RouterBiasBalancing needs a positive rate. Received: rate={rate!r}")
        self.rate = float(rate)
        self._given_distribution = distribution
        self._from_trainer = False  # attached in on_train_begin to the trainer's model (detached at its end)
        self.routers: list[tuple[str, nn.Module]] = []
        self.counts: list[torch.Tensor] = []
        self._handles: list = []
        self.distribution = None
        if model is not None:
            self._attach(model, distribution)

    def _attach(self, model: nn.Module, distribution) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                "RouterBiasBalancing's model must be a torch.nn.Module (pass the rate by name: "
                f"RouterBiasBalancing(rate=1e-3)). Received: model={model!r}"
            )
        self.routers = [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, _BIAS, None), torch.Tensor)]
        if not self.routers:
            raise ValueError(
                f"RouterBiasBalancing: {type(model).__name__} has no router with an {_BIAS!r} buffer (DeepSeek-V3's "
                f"bias-corrected router). Received: {type(model).__name__}"
            )
        for name, router in self.routers:
            if not isinstance(getattr(router, "top_k", None), int):
                raise ValueError(
                    f"RouterBiasBalancing: router {name!r} ({type(router).__name__}) has no int 'top_k'; the counts "
                    f"are taken from a top-k router's (logits, weights, indices) output. Received: {type(router)}"
                )
        if distribution is None:
            from trainmesh.distribution.distribution import distribution as current

            distribution = current()
        self.distribution = distribution
        self.counts = [torch.zeros(getattr(r, _BIAS).numel(), dtype=torch.int64) for _, r in self.routers]
        self._handles = [router.register_forward_hook(self._hook(i)) for i, (_, router) in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(module, args, output):
            # training forwards only: not in no-grad evaluation, nor in the forward that activation
            # checkpointing reruns inside backward (that would count the step's tokens twice)
            if not (module.training and torch.is_grad_enabled()) or torch._C._current_graph_task_id() != -1:
                return
            chosen = output[2].detach().reshape(-1)
            self.counts[i] += torch.bincount(chosen, minlength=self.counts[i].numel()).cpu()

        return hook

    def step(self) -> dict[str, torch.Tensor]:
        """Update every router's bias from the counts since the last call (summed over the batch axis),
        zero the counts, and return the global counts per router (for logging)."""
        from trainmesh._torch.moe_balance import batch_group

        total = torch.cat(self.counts)  # one all-reduce for every router (they may differ in size)
        group, _ = batch_group(self.distribution)
        if group is not None:
            bias = getattr(self.routers[0][1], _BIAS)
            # gloo reduces CPU tensors, NCCL those on the device: the counts go where the bias lives
            on_device = total.to(bias.device)
            dist.all_reduce(on_device, group=group)
            total = on_device.cpu()
        out = {}
        with torch.no_grad():
            for (name, router), counts in zip(self.routers, total.split([c.numel() for c in self.counts])):
                bias = getattr(router, _BIAS)
                load = counts.to(torch.float32)
                error = load.mean() - load  # > 0: under-loaded, its bias rises
                bias.add_(torch.sign(error).to(device=bias.device, dtype=bias.dtype), alpha=self.rate)
                out[name] = counts.clone()
        for counts in self.counts:
            counts.zero_()
        return out

    def remove(self) -> None:
        """Take the counting hooks off the routers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --- as a Trainer callback ----------------------------------------------------------
    def on_train_begin(self, logs=None) -> None:
        model = self.trainer.model
        if not isinstance(model, nn.Module):  # a pipeline runner: its stages' routers are not one module's
            raise ValueError(
                "RouterBiasBalancing needs the Trainer's model to be one torch.nn.Module (not a pipeline "
                f"schedule). Received: {type(model).__name__}"
            )
        # the trainer's distribution, not the one current where the callback was built (often none)
        distribution = self._given_distribution or self.trainer.distribution
        if self._from_trainer:  # a fit that raised never reached on_train_end: its hooks are still on
            self.on_train_end()
        if not self.routers:
            self._attach(model, distribution)
            self._from_trainer = True
            return
        held = {id(m) for m in model.modules()}
        stray = [name for name, router in self.routers if id(router) not in held]
        if stray:
            raise ValueError(
                "RouterBiasBalancing was given a model whose routers are not the Trainer's model's; pass no model "
                f"(RouterBiasBalancing(rate=...)) to take the trainer's. Received routers: {stray}"
            )
        self.distribution = distribution

    def on_train_batch_begin(self, step: int, logs=None) -> None:
        # only this step's forwards: not a fault-tolerant attempt that did not commit (its batch comes
        # again), nor forwards run between steps
        for counts in self.counts:
            counts.zero_()

    def on_train_batch_end(self, step: int, logs=None) -> None:
        # "skipped" is the same on every process (the overflow / non-finite flag was all-reduced), so
        # either all of them join step()'s all-reduce or none does
        if (logs or {}).get("skipped"):
            self.on_train_batch_begin(step)
            return
        self.step()

    def on_train_end(self, logs=None) -> None:
        if self._from_trainer:  # free for another fit (its trainer's model)
            self.remove()
            self.routers, self.counts, self._from_trainer = [], [], False
