"""A background thread that keeps the next batches ready, and (on CUDA) already on the device.

The thread pulls from an iterator (a torch DataLoader's, whose ``next()`` un-pickles what the
workers sent and is real work in the main process) into a bounded queue, so that work overlaps
the training step instead of adding to it. Torch's compute and CUDA copies release the GIL, so
the overlap is real even in one Python process.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator

import torch

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    """Run ``make_iterator()`` in a daemon thread, ``depth`` items ahead of the consumer.

    ``get()`` returns the next item (raising what the producer raised, ``StopIteration`` at the
    end) and adds the time it blocked to ``wait_s``. ``close()`` stops the thread: the producer
    checks a flag between items and never blocks on a full queue for long, so it cannot hang
    the process at exit (it is a daemon thread besides).
    """

    def __init__(self, make_iterator: Callable[[], Iterator[Any]], depth: int, name: str = "trainmesh-prefetch"):
        if depth < 1:
            raise ValueError(f"depth must be >= 1. Received: depth={depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._run, args=(make_iterator,), name=name, daemon=True)
        self._thread.start()

    def _run(self, make_iterator: Callable[[], Iterator[Any]]) -> None:
        try:
            for item in make_iterator():
                if not self._put(item):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failure(exc))
            return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Any:
        if self._done:
            raise StopIteration
        started = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("The prefetch thread ended without a result") from None
        self.wait_s += time.perf_counter() - started
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.exc
        return item

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(fn, b) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, b) for b in batch)
    if isinstance(batch, dict):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    return batch


class DeviceTransfer:
    """Pin host memory and, for a CUDA ``device``, copy on a side stream in the producer thread.

    ``to_device`` runs in the producer thread; ``ready`` runs in the consumer thread and makes
    the consumer's current stream wait for the copy (and tells the caching allocator the
    tensors are used there), so nothing reads a half-copied batch. Everything CUDA is behind
    ``torch.cuda.is_available()``: on CPU this is the identity.
    """

    def __init__(self, device: str | torch.device | None, pin_memory: bool | str):
        cuda = torch.cuda.is_available()
        self.device = torch.device(device) if device is not None else None
        if pin_memory == "auto":
            pin_memory = cuda
        elif pin_memory not in (True, False):
            raise ValueError(f"pin_memory must be True, False or 'auto'. Received: pin_memory={pin_memory!r}")
        self.pin_memory = bool(pin_memory) and cuda  # pinning needs a CUDA driver; silently off on CPU
        self.stream = None
        if self.device is not None and self.device.type == "cuda" and cuda:
            self.stream = torch.cuda.Stream(device=self.device)

    def to_device(self, batch: Any) -> tuple[Any, Any]:
        if self.pin_memory:
            batch = map_tensors(lambda t: t if t.is_pinned() else t.pin_memory(), batch)
        if self.stream is None:
            if self.device is not None:
                batch = map_tensors(lambda t: t.to(self.device), batch)
            return batch, None
        with torch.cuda.stream(self.stream):
            batch = map_tensors(lambda t: t.to(self.device, non_blocking=True), batch)
            event = torch.cuda.Event()
            event.record(self.stream)
        return batch, event

    def ready(self, batch: Any, event: Any) -> Any:
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            map_tensors(lambda t: t.record_stream(current), batch)
        return batch
