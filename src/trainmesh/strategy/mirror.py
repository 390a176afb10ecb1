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
  others and one unused everywhere keeps ``grad=None`` (the optimizer skips it, as on one device);
* a module wrapped in ``DistributedDataParallel`` (``strategy.distribution.distribute_model``,
  the Trainer, or by hand) is noticed through ``register_module_module_registration_hook``
  (DDP registers it as its ``.module``): DDP *averages* those gradients in backward, for a
  per-replica mean loss, so the step hook leaves them alone instead of reducing them twice.

Lifetime: the parameter/buffer registration hooks live only while a scope is open. The step
hook is installed when the first parameter is mirrored (only with more than one replica) and
removed by ``close()``, or by itself at the first optimizer step after every mirrored
parameter has been garbage-collected (parameters are held weakly). The DDP watcher lives
while either does. Buffers are broadcast once, at the start, and not synchronised
afterwards (BatchNorm statistics stay per replica).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from typing import Callable, Iterable, Iterator

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.nn.parameter import is_lazy
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .buckets import all_reduce_gradients, broadcast_tensors


def _is_dtensor(tensor: torch.Tensor) -> bool:
    # No DTensor can exist unless its module was imported; don't import it (slow) to find out.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


class MirroredVariables:
    """The parameters one strategy mirrors, and the hooks that keep them in sync."""

    def __init__(
        self,
        *,
        src_rank: int,
        num_replicas: int,
        device: Callable[[], torch.device],
        ensure_group: Callable[[], None],
        bucket_cap_mb: float = 25.0,
    ):
        self._src_rank = int(src_rank)
        self._num_replicas = int(num_replicas)
        self._device = device
        self._ensure_group = ensure_group
        self._cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        # Strong references, in registration order: identical on every replica (SPMD), whereas
        # garbage collection of a weak list could differ and desynchronise the broadcasts.
        self._pending: list[torch.Tensor] = []
        self._mirrored = WeakIdKeyDictionary()  # parameter -> True
        self._reduced_elsewhere = WeakIdKeyDictionary()  # parameters DDP already averages
        self._skip_next_step: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._capture_handles: list = []
        self._capture_depth = 0
        self._step_handle = None
        self._watch_handle = None

    # --- capture while a scope is open ---------------------------------------------------
    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        if self._capture_depth == 0:
            self._capture_handles = [
                register_module_parameter_registration_hook(self._on_register),
                register_module_buffer_registration_hook(self._on_register),
            ]
        self._capture_depth += 1
        self._update_watch()
        try:
            yield
        finally:
            self._capture_depth -= 1
            if self._capture_depth <= 0:  # also after a close() inside the scope
                self._capture_depth = 0
                for handle in self._capture_handles:
                    handle.remove()
                self._capture_handles = []
            self._update_watch()

    def _on_register(self, module, name, tensor) -> None:
        if tensor is not None:
            self._pending.append(tensor)

    def _update_watch(self) -> None:
        wanted = self._capture_depth > 0 or self._step_handle is not None
        if wanted and self._watch_handle is None:
            self._watch_handle = register_module_module_registration_hook(self._on_module_registered)
        elif not wanted and self._watch_handle is not None:
            self._watch_handle.remove()
            self._watch_handle = None

    def _on_module_registered(self, parent, name, module) -> None:
        from torch.nn.parallel import DistributedDataParallel  # already imported by torch.nn

        if isinstance(parent, DistributedDataParallel) and module is not None:
            self.exclude(module.parameters())

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
            if _is_dtensor(tensor):
                continue  # laid out by ModelParallel, which keeps its own replicas consistent
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
            self._update_watch()

    def exclude(self, params: Iterable[torch.Tensor]) -> None:
        """Leave these parameters' gradients to someone else (DDP averages them in backward)."""
        for param in params:
            self._reduced_elsewhere[param] = True

    # --- gradients ------------------------------------------------------------------------
    def _params_of(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [
            p
            for group in optimizer.param_groups
            for p in group["params"]
            if p.requires_grad and p in self._mirrored and p not in self._reduced_elsewhere
        ]

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
        self._update_watch()

    def close(self) -> None:
        """Stop mirroring: remove every hook and forget every parameter (they keep their values)."""
        self.remove_step_hook()
        for handle in self._capture_handles:
            handle.remove()
        self._capture_handles, self._capture_depth = [], 0
        self._update_watch()
        self._pending = []
        self._mirrored = WeakIdKeyDictionary()
        self._reduced_elsewhere = WeakIdKeyDictionary()
        self._skip_next_step = weakref.WeakKeyDictionary()
