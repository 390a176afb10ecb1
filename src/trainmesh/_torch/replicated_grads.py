"""The adapters of a ZeRO-3 LoRA model replicated, their gradients averaged by one flat all-reduce per backward.

Under ZeRO-3 every trainable parameter is an FSDP2 shard: gathered (as a DTensor's local rows) with its
unit, its gradient reduce-scattered per unit (on gloo an all-reduce of the unit's rows), the optimizer
stepping DTensors. For a LoRA block kept gathered whole (``frozen_units.py``) that meant, per unit, a
blocking gradient collective over a few KB of adapters, and DTensor dispatch in every optimizer op.
The adapters are a few percent of the model: replicating them costs ``3 x`` their bytes (parameter,
gradient, optimizer state) on each process, as DDP does, and saves all of that. So ``zero.apply_fsdp``
leaves them out of FSDP2 (``ignored_params``); the frozen base stays sharded, gathered once per step.

``FlatGradAllReduce`` averages their gradients as DDP would, in one call: when backward ends (a callback
queued by the first adapter gradient to arrive), every replicated gradient is copied into one flat buffer
per dtype, all-reduced, divided by the group's size and copied back. A parameter without a gradient on
some process counts as zeros there; one without a gradient on every process stays without (a flag per
parameter rides in the same buffer), as FSDP2 and one process leave it. Gradient accumulation: at stage 3
every micro-step's backward reduces (``sync.no_sync`` does not skip it, as for FSDP2's reduce-scatter); the
gradient already accumulated is the same on every process, so averaging it again leaves it unchanged and
adds the mean of the new micro-step's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class FlatGradAllReduce:
    """Average the gradients of ``names`` (parameters of ``model`` replicated on every process of ``group``)."""

    def __init__(self, model: nn.Module, names: list[str], group):
        self.model, self.names, self.group = model, list(names), group
        self.size = dist.get_world_size(group)
        self._hooked: list[nn.Parameter] = []
        self._slots: list[tuple[nn.Module, str]] | None = None  # (owning module, attribute) per name
        self._queued = False
        self.calls = 0  # all-reduces issued (tests count them)
        self._comms: dict = {}  # dtype -> its compressed reduce-scatter, or None (found at the first backward)
        # The parameters are looked up at each forward: a meta-built model's are replaced when it is materialised.
        model.register_forward_pre_hook(self._hook_params)

    def params(self) -> list[nn.Parameter]:
        return [self.model.get_parameter(name) for name in self.names]

    def _hook_params(self, *_) -> None:
        # Each parameter's owning module, looked up once: ``get_parameter`` walks the module path by name
        # (84 lookups cost ~5 ms a forward at finetune.py --size medium); a dict read per parameter sees a
        # replaced parameter (materialisation) as well.
        if self._slots is not None and all(m._parameters.get(n) is q for (m, n), q in zip(self._slots, self._hooked)):
            return
        self._slots = [self._slot(name) for name in self.names]
        params = [m._parameters[n] for m, n in self._slots]
        for p in params:
            if not any(p is q for q in self._hooked):
                p.register_post_accumulate_grad_hook(self._arrived)
        self._hooked = params

    def _slot(self, name: str) -> tuple[nn.Module, str]:
        module_path, _, attr = name.rpartition(".")
        return self.model.get_submodule(module_path), attr

    def _arrived(self, _param: torch.Tensor) -> None:
        if not self._queued:  # once per backward, run by autograd after the last gradient is accumulated
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _compressed(self, dtype: torch.dtype):
        """A compressed reduce-scatter for the flat buffer of ``dtype``, when the Trainer gave the FSDP2 units
        one (``compression=`` at ZeRO 2-3): the adapters' gradients then travel compressed too, as the rest of
        a ZeRO model's do. Its own instance, under its own residual key (``<replicated float32>``), sharing the
        units' compressor and byte counter: borrowing a unit's (the root's, as first written) made the flat
        buffers of two dtypes, and that unit's own reduce-scatter, share one error-feedback residual key,
        which ``Compressor.compress`` refuses at the second shape. Looked for in every unit: the root may
        hold no parameters (no param group, so no custom reduce-scatter) when its children hold them all."""
        if dtype not in self._comms:
            from trainmesh.comm.reduce_scatter import CompressedReduceScatter

            from .zero import fsdp_units  # zero.py imports this module

            self._comms[dtype] = None
            for _, unit in fsdp_units(self.model):
                state = unit._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
                comm = next((g._reduce_scatter_comm for g in groups if _compressor_of(g) is not None), None)
                if comm is not None:
                    self._comms[dtype] = CompressedReduceScatter(comm.compressor, f"<replicated {dtype}>", comm.counter)
                    break
        return self._comms[dtype]

    def _all_reduce(self, flat: torch.Tensor, compressed) -> torch.Tensor:
        self.calls += 1
        if compressed is None:
            dist.all_reduce(flat, group=self.group)
            return flat
        # compressed: reduce-scatter the rows through the compressor, all-gather the reduced rows whole
        padded = torch.cat([flat, flat.new_zeros((-flat.numel()) % self.size)])
        row = padded.new_empty(padded.numel() // self.size)
        compressed(row, padded, self.group, dist.ReduceOp.SUM)
        dist.all_gather_into_tensor(padded, row, group=self.group)
        return padded[: flat.numel()]

    def _reduce(self) -> None:
        self._queued = False
        params = self._hooked
        compressed = self._compressed(params[0].dtype) if params else None  # whether any: the same for each
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        for n, (dtype, indices) in enumerate(by_dtype.items()):
            parts = [
                (params[i].grad if params[i].grad is not None else torch.zeros_like(params[i])).reshape(-1)
                for i in indices
            ]
            if n == 0 and compressed is None:  # one flag per parameter (which have a gradient somewhere) rides along
                parts.append(flags.to(dtype))
            if compressed is not None:
                compressed = self._compressed(dtype)
            flat = self._all_reduce(torch.cat(parts), compressed)
            # one division and one foreach copy for the whole buffer, not three ops per parameter (the same
            # values: the division is elementwise either way)
            numels = [params[i].numel() for i in indices]
            offset = sum(numels)
            means = [m.view_as(params[i]) for m, i in zip(flat[:offset].div_(self.size).split(numels), indices)]
            present = [(params[i].grad, m) for m, i in zip(means, indices) if params[i].grad is not None]
            if present:
                torch._foreach_copy_([g for g, _ in present], [m for _, m in present])
            for m, i in zip(means, indices):
                if params[i].grad is None:
                    params[i].grad = m.clone()
            if n == 0 and compressed is None:
                flags = flat[offset:].float()
        if compressed is not None:  # a lossy compressor must not drop a flag: these travel as they are
            dist.all_reduce(flags, group=self.group)
        for i, p in enumerate(params):
            if flags[i] == 0:
                p.grad = None  # no process had one: left without, as on one process


def _compressor_of(group):
    return getattr(getattr(group, "_reduce_scatter_comm", None), "compressor", None)
