"""Mirrored parameters: identical on every replica at start, gradients summed before every step.

TF mirrors a variable when it is created under ``strategy.scope()`` and all-reduces (SUM)
its gradients in ``apply_gradients``. The torch equivalent, with torch's global hooks:

* while a scope is open, ``register_module_{parameter,buffer}_registration_hook`` collects
  every parameter and buffer that a module registers (module constructors register first
  and initialise afterwards, so nothing can be copied yet);
* at the next sync point (scope exit; or ``strategy.run``, a distributed dataset's
  iteration, an optimizer step when training happens inside the scope) they are moved to
  this replica's device and broadcast from replica 0 in a few flat buffers;
* one global ``register_optimizer_step_pre_hook`` all-reduces (SUM) the gradients of the
  mirrored parameters an optimizer is about to step, bucketed into flat buffers of at most
  ``bucket_cap_mb``, all buckets in flight at once. A per-parameter "has a gradient" flag
  rides in each bucket, so a parameter unused on some replicas still gets the sum of the
  others and one unused everywhere keeps ``grad=None`` (the optimizer skips it, as on one device).

Lifetime: the registration hooks live only while a scope is open. The step hook is installed
when the first parameter is mirrored (only with more than one replica) and removed by
``close()``, or by itself at the first optimizer step after every mirrored parameter has
been garbage-collected (parameters are held weakly). Buffers are broadcast once, at the
start, and not synchronised afterwards (BatchNorm statistics stay per replica, as in TF).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_buffer_registration_hook, register_module_parameter_registration_hook
from torch.nn.parameter import is_lazy
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Group tensors by (device, dtype), in order, into runs of at most ``cap_bytes`` each.

    The grouping depends only on parameters' metadata, identical on every replica, so every
    replica issues the same collectives in the same order.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for group in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for tensor in group:
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > cap_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(tensor)
            size += nbytes
        if bucket:
            yield bucket


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], src: int, cap_bytes: int) -> None:
    """Overwrite ``tensors`` on every process with process ``src``'s values (flat buffers)."""
    for bucket in _buckets(tensors, cap_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, src=src)
        if dist.get_rank() != src:
            for tensor, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                tensor.copy_(part.view_as(tensor))


@torch.no_grad()
def all_reduce_gradients(params: list[torch.Tensor], cap_bytes: int) -> None:
    """SUM every parameter's ``.grad`` over all processes, in place; ``None`` counts as zeros."""
    for param in params:
        if param.grad is not None and param.grad.layout != torch.strided:
            raise ValueError(f"Mirrored parameters need dense gradients. Received: grad layout={param.grad.layout}")
    in_flight = []
    for bucket in _buckets(params, cap_bytes):
        sizes = [p.numel() for p in bucket]
        total = sum(sizes)
        flat = torch.zeros(total + len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
        offset = 0
        for i, (param, size) in enumerate(zip(bucket, sizes)):
            if param.grad is not None:
                flat[offset:offset + size].copy_(param.grad.reshape(-1))
                flat[total + i] = 1  # "this replica has a gradient" flag, summed with the rest
            offset += size
        in_flight.append((bucket, sizes, flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)))
    for bucket, sizes, flat, work in in_flight:
        work.wait()
        total = sum(sizes)
        parts = flat[:total].split(sizes)
        flags = flat[total:].tolist()  # one device->host copy per bucket, not one per parameter
        for param, part, flag in zip(bucket, parts, flags):
            if flag == 0:
                continue  # no replica produced a gradient: stays None, the optimizer skips it
            if param.grad is None:
                param.grad = part.view_as(param).clone()
            else:
                param.grad.copy_(part.view_as(param.grad))


class MirroredVariables:
    """The parameters one strategy mirrors, and the hooks that keep them in sync."""

    def __init__(self, *, src_rank: int, num_replicas: int, device: Callable[[], torch.device],
                 ensure_group: Callable[[], None], bucket_cap_mb: float = 25.0):
        self._src_rank = int(src_rank)
        self._num_replicas = int(num_replicas)
        self._device = device
        self._ensure_group = ensure_group
        self._cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        # Strong references, in registration order: identical on every replica (SPMD), whereas
        # garbage collection of a weak list could differ and desynchronise the broadcasts.
        self._pending: list[torch.Tensor] = []
        self._mirrored = WeakIdKeyDictionary()          # parameter -> True
        self._reduced_elsewhere = WeakIdKeyDictionary()  # parameters DDP already averages
        self._skip_next_step: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._capture_handles: list = []
        self._capture_depth = 0
        self._step_handle = None

    # --- capture while a scope is open ---------------------------------------------------
    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        if self._capture_depth == 0:
            self._capture_handles = [register_module_parameter_registration_hook(self._on_register),
                                     register_module_buffer_registration_hook(self._on_register)]
        self._capture_depth += 1
        try:
            yield
        finally:
            self._capture_depth -= 1
            if self._capture_depth <= 0:  # also after a close() inside the scope
                self._capture_depth = 0
                for handle in self._capture_handles:
                    handle.remove()
                self._capture_handles = []

    def _on_register(self, module, name, tensor) -> None:
        if tensor is not None:
            self._pending.append(tensor)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def discard_pending(self, since: int = 0) -> None:
        del self._pending[since:]

    # --- mirror ------------------------------------------------------------------------------
    def is_mirrored(self, param: torch.Tensor) -> bool:
        return param in self._mirrored

    def flush(self) -> None:
        """Move pending tensors to this replica's device and broadcast them from replica 0."""
        if not self._pending:
            return
        seen: set[int] = set()
        ready, later = [], []
        for tensor in self._pending:
            if id(tensor) in seen or tensor in self._mirrored:
                continue
            seen.add(id(tensor))
            # Lazy (uninitialised) and meta tensors have no values yet: mirror them once they do.
            (later if is_lazy(tensor) or tensor.is_meta else ready).append(tensor)
        self._pending = later
        device = self._device()
        for tensor in ready:
            if tensor.device != device:
                tensor.data = tensor.data.to(device)  # what Module.to() does: same object, new storage
        if self._num_replicas > 1 and ready:
            self._ensure_group()
            broadcast_tensors(ready, self._src_rank, self._cap_bytes)
        params = [t for t in ready if isinstance(t, torch.nn.Parameter)]
        for param in params:
            self._mirrored[param] = True
        if params and self._num_replicas > 1 and self._step_handle is None:
            self._step_handle = register_optimizer_step_pre_hook(self._before_step)

    def exclude(self, params: Iterable[torch.Tensor]) -> None:
        """Leave these parameters' gradients to someone else (DDP averages them in backward)."""
        for param in params:
            self._reduced_elsewhere[param] = True

    # --- gradients ------------------------------------------------------------------------
    def _params_of(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]
                if p.requires_grad and p in self._mirrored and p not in self._reduced_elsewhere]

    def aggregate(self, optimizer: torch.optim.Optimizer) -> None:
        """SUM the gradients of ``optimizer``'s mirrored parameters now; its next step won't again."""
        self.flush()
        params = self._params_of(optimizer)
        if params and self._num_replicas > 1:
            self._ensure_group()
            all_reduce_gradients(params, self._cap_bytes)
            self._skip_next_step[optimizer] = True

    def _before_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if self._pending:
            warnings.warn(
                "Parameters created under strategy.scope() are being stepped before they were mirrored "
                "(training inside the scope without strategy.run?); they are mirrored now, but this "
                "first step's gradients came from unsynchronised weights.",
                stacklevel=3,
            )
            self.flush()
        if len(self._mirrored) == 0:
            self.remove_step_hook()  # every mirrored parameter is gone: nothing to keep in sync
            return
        if self._skip_next_step.pop(optimizer, False):
            return
        params = self._params_of(optimizer)
        if params:
            all_reduce_gradients(params, self._cap_bytes)

    # --- lifetime ---------------------------------------------------------------------------
    @property
    def step_hook_installed(self) -> bool:
        return self._step_handle is not None

    def remove_step_hook(self) -> None:
        if self._step_handle is not None:
            self._step_handle.remove()
            self._step_handle = None

    def close(self) -> None:
        """Stop mirroring: remove every hook and forget every parameter (they keep their values)."""
        self.remove_step_hook()
        for handle in self._capture_handles:
            handle.remove()
        self._capture_handles, self._capture_depth = [], 0
        self._pending = []
        self._mirrored = WeakIdKeyDictionary()
        self._reduced_elsewhere = WeakIdKeyDictionary()
        self._skip_next_step = weakref.WeakKeyDictionary()
