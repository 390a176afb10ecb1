"""The raw ZeroMQ ceiling a PS push is compared with: one buffer sent to an echo thread,
a 3-byte ack back per message (``benchmarks/ps.py``)."""

from __future__ import annotations

import queue
import threading
import time

from .transport import ZmqClientTransport, ZmqServerTransport


def loopback_bandwidth(nbytes: int, repeats: int = 10, warmup: int = 2, window: int = 1) -> dict[str, float]:
    """Raw ZeroMQ loopback throughput: send `nbytes` (from one buffer, without a copy), a 3-byte
    ack back for each message, `repeats` times (after `warmup` rounds), with up to `window`
    messages in flight. The PS benchmark compares dense push throughput with this ceiling."""
    if nbytes < 1 or repeats < 1 or warmup < 0 or window < 1:
        raise ValueError(
            f"need nbytes >= 1, repeats >= 1, warmup >= 0, window >= 1; got {nbytes}, {repeats}, {warmup}, {window}"
        )
    ready: queue.Queue = queue.Queue()

    def echo_ack() -> None:
        server = ZmqServerTransport()  # created in the thread that uses it
        ready.put(server.address)
        try:
            for _ in range(warmup + repeats):
                if (got := server.recv(timeout_s=30.0)) is None:
                    return
                server.send(got[0], b"ack")
        finally:
            server.close()

    thread = threading.Thread(target=echo_ack, name="loopback-bandwidth-server", daemon=True)
    thread.start()
    client, payload = ZmqClientTransport(ready.get(timeout=30.0), b"bandwidth-client"), bytes(nbytes)
    acked = 0

    def wait_ack() -> None:
        nonlocal acked
        if client.recv(timeout_s=30.0) is None:
            raise TimeoutError("loopback bandwidth server did not answer within 30 s")
        acked += 1

    try:
        for _ in range(warmup):
            client.send(payload)
            wait_ack()
        start, in_flight = time.perf_counter(), 0
        for _ in range(repeats):
            client.send(payload)
            in_flight += 1
            if in_flight >= window:
                wait_ack()
                in_flight -= 1
        for _ in range(in_flight):
            wait_ack()
        seconds = time.perf_counter() - start
    finally:
        client.close()
        thread.join(timeout=30.0)
    return {
        "nbytes": nbytes,
        "repeats": repeats,
        "window": window,
        "seconds": seconds,
        "acked": acked - warmup,
        "seconds_per_message": seconds / repeats,
        "bytes_per_s": nbytes * repeats / seconds,
    }
