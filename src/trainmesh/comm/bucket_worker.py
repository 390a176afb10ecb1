"""One background thread per DDP hook that runs each bucket's collectives while backward goes on.

DDP calls a communication hook for bucket ``k`` as soon as its gradients are ready and waits
for the returned futures only at the end of backward. A hook that communicates inline blocks
autograd for the whole exchange; this worker lets the hook return at once with a pending
future, so the next buckets' gradients are computed while this one travels (as Horovod's and
BytePS's background threads do).

Why one thread and a FIFO queue, not future callbacks: gloo matches collectives by the order
in which each process issues them. DDP calls the hooks in bucket order on every rank, so a
single consumer that runs jobs in arrival order issues every rank's collectives in the same
order. Collectives issued from ``Future.then`` callbacks run on whichever thread completes the
previous work, in an order that can differ between ranks: a hang.

Buckets can also be *merged* (``bucket_bytes``): consecutive DDP buckets are held until their
total reaches ``bucket_bytes`` or DDP hands over its last bucket, then reduced as one message.
That is how ``communication="auto"`` sets the message size on a high-latency link without
rebuilding DDP (whose bucket size is fixed at construction).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch


class BucketWorker:
    """Runs submitted jobs in order on a daemon thread; each job completes its own future.

    ``run(job)`` (``job() -> torch.Tensor``) returns a ``torch.futures.Future`` at once. An
    exception inside a job is set on its future (DDP re-raises it at the end of backward).
    """

    def __init__(self, name: str = "trainmesh-comm") -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                future.set_result(job())
            except BaseException as error:  # noqa: BLE001 - handed to the waiting DDP reducer
                future.set_exception(error)

    def run(self, job: Callable[[], torch.Tensor]) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        self._jobs.put((job, future))
        return future

    def drain(self) -> None:
        """Block until every submitted job has finished (a no-op marker job)."""
        self.run(lambda: torch.zeros(0)).wait()


class BucketMerger:
    """Holds DDP buckets until ``bucket_bytes`` are pending (or the last bucket), then submits one job.

    ``reduce(parts) -> list[torch.Tensor]`` gets the held parts (whatever the hook passes in
    ``add``) and returns one result tensor per part. ``bucket_bytes=0`` submits every bucket alone.
    """

    def __init__(self, worker: BucketWorker, reduce: Callable[[list], list], bucket_bytes: int = 0) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be an int >= 0. Received: bucket_bytes={bucket_bytes!r}")
        self.worker, self.reduce, self.bucket_bytes = worker, reduce, bucket_bytes
        self._parts: list = []
        self._futures: list[torch.futures.Future] = []
        self._pending_bytes = 0

    def add(self, part, nbytes: int, last: bool) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        self._parts.append(part)
        self._futures.append(future)
        self._pending_bytes += nbytes
        if last or self._pending_bytes >= self.bucket_bytes:
            parts, futures = self._parts, self._futures
            self._parts, self._futures, self._pending_bytes = [], [], 0

            def job() -> torch.Tensor:
                try:
                    results = self.reduce(parts)
                except BaseException as error:  # noqa: BLE001
                    for f in futures:
                        f.set_exception(error)
                    raise
                for f, result in zip(futures, results):
                    f.set_result(result)
                return torch.zeros(0)

            self.worker.run(job)
        return future
