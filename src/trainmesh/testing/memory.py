"""``LiveTensorBytes``: the bytes held by live tensor storages, now and at most, seen from the dispatcher;
``SavedTensorBytes``: the bytes autograd saves for backward inside a block.

The measured side of every memory comparison (the planner against real steps, ZeRO against
DeepSpeed) counts the same quantity the planner models: bytes of tensor storage, without the
allocator's caching, Python objects, gloo's buffers or the interpreter. A ``TorchDispatchMode``
registers every storage an operator returns (parameters, DDP's buckets, gradients, optimizer
state, activations, temporaries) and drops it when its last reference dies (a weakref callback).

Two ways a storage changes size without returning a new tensor are followed too: in-place ops
with a mutable schema (``set_``, ``resize_`` on a tensor) re-read their arguments, and
``UntypedStorage.resize_`` (how FSDP2 frees and re-allocates gathered parameters, outside the
dispatcher) is patched while the tracker is active. A DTensor counts as its local shard, the
storage this rank holds. Meta and fake tensors hold no memory and are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveTensorBytes", "SavedTensorBytes"]


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of tensor storage alive now (``live``) and at most since entry or ``reset_peak`` (``peak``).

    ``device_type`` limits the count to one kind of device ("cpu", "cuda"); None counts every
    device but meta.

    >>> with LiveTensorBytes("cpu") as memory:          # doctest: +SKIP
    ...     trainer.fit(data, epochs=1)
    >>> memory.peak                                      # doctest: +SKIP
    """

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage id (its C++ pointer) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._original_resize = None

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def track(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` (once), or its new size if it was counted at another size."""
        device = storage.device.type
        if device == "meta" or (self.device_type is not None and device != self.device_type):
            return
        key, size = storage._cdata, storage.nbytes()
        counted = self._sizes.get(key)
        if counted is None:
            try:
                self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._release(key))
            except TypeError:  # not weak-referenceable: counted and never released (rare and small)
                pass
            self._sizes[key] = size
            self.live += size
        elif counted != size:
            self._sizes[key] = size
            self.live += size - counted
        self.peak = max(self.peak, self.live)

    def _track_tensor(self, tensor) -> None:
        local = getattr(tensor, "_local_tensor", None)  # a DTensor: the shard this rank holds
        tensor = tensor if local is None else local
        # Plain tensors and parameters only: other subclasses (fake, functional) wrap no storage of their own.
        if isinstance(tensor, torch.Tensor) and type(tensor) in (torch.Tensor, nn.Parameter) and not tensor.is_meta:
            self.track(tensor.untyped_storage())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track_tensor(value)
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:  # set_ / resize_ in place change an argument's storage
            for value in tree_flatten((args, kwargs))[0]:
                if isinstance(value, torch.Tensor):
                    self._track_tensor(value)
        return out

    def reset_peak(self) -> None:
        """From now on, the peak of what follows (storages alive now stay counted while they live)."""
        self.peak = self.live

    def __enter__(self):
        tracker = self
        self._original_resize = original = torch.UntypedStorage.resize_

        def resize_(storage, size):
            result = original(storage, size)
            tracker.track(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard; an in-flight collective's result tensor (what this rank's memory holds)."""
    tensor = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
    return tensor.elem if type(tensor).__name__ == "AsyncCollectiveTensor" else tensor


class SavedTensorBytes:
    """Bytes of the tensors autograd saves for backward inside the block (``saved_tensors_hooks``), each
    storage once, ``model``'s parameters not: the activations a step keeps, as the planner counts them.

    >>> with SavedTensorBytes(model) as saved:           # doctest: +SKIP
    ...     loss = loss_fn(model(x), y)
    >>> saved.bytes                                      # doctest: +SKIP
    """

    def __init__(self, model: nn.Module | None = None):
        self._params = set() if model is None else {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() not in self._params and storage.nbytes():
            self._seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
