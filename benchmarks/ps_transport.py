"""ps.py's part 1, transport: PS pushes and pulls against raw ZeroMQ for the same messages (dense 1 MB and 16 MB,
and sparse rows), one client against 2 local server processes, interleaved round by round with the two raw sides
(``loopback_bandwidth``'s echo thread, and ``ProcessLoopback``: a pyzmq echo in another process that applies what
it receives as a server's SGD step does), and the same-work check on what the servers and the echo applied. The
script's docstring says what each side moves and how the ratios are taken.

It exists apart from the script because it holds the figures' measurement and its same-work check in one place
(``ps_push_1mb_vs_raw_zmq``, ``ps_sparse_push_vs_raw_zmq``), apart from the parts that measure something else.
"""

from __future__ import annotations

import collections
import statistics
import subprocess
import sys
import time

import torch

from trainmesh.ps.client import PSClient
from trainmesh.ps.cluster import LocalCluster
from trainmesh.ps.loopback_bandwidth import loopback_bandwidth
from trainmesh.testing.stats import ci95

MB = 1 << 20
DENSE_SIZES = {"1 MB": MB, "16 MB": 16 * MB}
ROWS, ROW_DIM, ROWS_PER_PUSH = 1_000_000, 64, 1024


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# --- part 1: push / pull against raw ZeroMQ --------------------------------------------------------
_ECHO_SERVER = """
import sys, zmq, torch
torch.set_num_threads(1)
table, dense, applied = None, {}, 0
sock = zmq.Context().socket(zmq.ROUTER)
print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    peer, *frames = sock.recv_multipart(copy=False)
    if len(frames[0]) == 0:
        sock.send_multipart([peer, str(applied).encode()])
        break
    if len(frames) == 2:  # a sparse push: int64 ids, fp32 rows; applied as the PS applies SGD
        if table is None:
            table = torch.zeros(int(sys.argv[1]), int(sys.argv[2]))
        ids = torch.frombuffer(frames[0].buffer, dtype=torch.int64)
        rows = torch.frombuffer(frames[1].buffer, dtype=torch.float32).view(ids.numel(), -1)
        table.index_add_(0, ids, rows, alpha=-1.0)
    else:  # a dense push: fp32 gradient, applied to a value of its size as the PS's SGD step does
        grad = torch.frombuffer(frames[0].buffer, dtype=torch.float32)
        value = dense.get(grad.numel())
        if value is None:
            value = dense[grad.numel()] = torch.zeros(grad.numel())
        value.add_(grad, alpha=-1.0)
    applied += 1
    sock.send_multipart([peer, b"ack"])
"""


class ProcessLoopback:
    """Raw pyzmq to another process: send ``nbytes`` (one buffer, copy=False), a 3-byte ack per
    message, up to ``window`` messages in flight."""

    def __init__(self):
        import zmq

        self.process = subprocess.Popen(
            [sys.executable, "-c", _ECHO_SERVER, str(ROWS), str(ROW_DIM)], stdout=subprocess.PIPE, text=True
        )
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.connect(f"tcp://127.0.0.1:{int(self.process.stdout.readline())}")

    def bandwidth(self, nbytes: int, repeats: int, window: int, rows=None, dense=None) -> tuple[float, int]:
        """(bytes/s, messages acknowledged) over ``repeats`` messages after one warm-up message.
        ``dense``: an fp32 gradient of ``nbytes`` that the echo applies to a value of its size
        (``add_``, a PS server's plain-SGD step). ``rows=(ids, grads)``: each message is those two
        buffers instead, applied to the echo's 1M-row table with ``index_add_``. Every message sent
        is applied before its ack (``close`` returns the count)."""
        payload = (
            [dense.numpy() if dense is not None else bytes(nbytes)]
            if rows is None
            else [rows[0].numpy(), rows[1].numpy()]
        )

        def send() -> None:
            self.socket.send_multipart(payload, copy=False)

        send()
        self.socket.recv()
        acked, in_flight = 0, 0
        started = time.perf_counter()
        for _ in range(repeats):
            send()
            in_flight += 1
            if in_flight >= window:
                self.socket.recv()
                in_flight, acked = in_flight - 1, acked + 1
        for _ in range(in_flight):
            self.socket.recv()
            acked += 1
        return nbytes * repeats / (time.perf_counter() - started), acked

    def close(self) -> int:
        """Stop the echo; returns how many messages it applied."""
        self.socket.send(b"")
        applied = int(self.socket.recv())
        self.socket.close(linger=0)
        self.process.wait(120)  # (its exit took over 10 s at load 30-50 once, failing a run)
        return applied


def _pipelined(submit, repeats: int, window: int) -> tuple[float, int]:
    """(seconds, futures that succeeded) for ``repeats`` calls of ``submit()`` (a future), with
    up to ``window`` of them in flight; a failed one raises."""
    in_flight: collections.deque = collections.deque()
    done = 0
    started = time.perf_counter()
    for _ in range(repeats):
        in_flight.append(submit())
        if len(in_flight) >= window:
            in_flight.popleft().result()
            done += 1
    while in_flight:
        in_flight.popleft().result()
        done += 1
    return time.perf_counter() - started, done


def _int_grad(shape, seed: int) -> torch.Tensor:
    """Small integers as float32: any number of them sums exactly, so the server state after a run
    must equal count * grad bit for bit (the same-work check)."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()


def transport_part(rounds: int, repeats: int, window: int) -> dict:
    labels = [*DENSE_SIZES, "sparse"]
    out: dict = {
        label: {
            "loopback_bps": [],
            "process_loopback_bps": [],
            "push_bps": [],
            "pull_s": [],
            "push_bps_w1": [],
            "loopback_bps_w1": [],
            "process_loopback_bps_w1": [],
        }
        for label in labels
    }
    pushes = {label: 0 for label in labels}  # every push acknowledged, warm-ups included
    raw_applied = 0  # sparse messages the raw echo acknowledged (each must have been applied)
    problems: list[str] = []
    echo = ProcessLoopback()
    with (
        LocalCluster(2, num_workers=1) as cluster,
        PSClient(servers=cluster.addresses, worker_id=0, num_workers=1, secret=cluster.secret) as client,
    ):
        # lr 1 and integer gradients: the servers' values after the run are exactly -pushes * grad.
        sgd = {"name": "sgd", "lr": 1.0}
        grads = {label: _int_grad((size // 4,), i) for i, (label, size) in enumerate(DENSE_SIZES.items())}
        client.init(
            [
                {"name": label, "kind": "dense", "value": torch.zeros(size // 4), "optimizer": sgd}
                for label, size in DENSE_SIZES.items()
            ]
            + [{"name": "rows", "kind": "sparse", "shape": [ROWS, ROW_DIM], "init": {"zeros": True}, "optimizer": sgd}]
        )
        ids = torch.randperm(ROWS, generator=torch.Generator().manual_seed(7))[:ROWS_PER_PUSH]
        row_grads = _int_grad((ROWS_PER_PUSH, ROW_DIM), 9)
        for r in range(rounds):
            for label in labels if r % 2 == 0 else list(reversed(labels)):
                nbytes = DENSE_SIZES.get(label, ROWS_PER_PUSH * (ROW_DIM * 4 + 8))
                if label == "sparse":
                    push = lambda: client.push_rows("rows", ids, row_grads)  # noqa: E731
                    pull = lambda: client.pull_rows("rows", ids).result()  # noqa: E731
                else:
                    push = lambda: client.push({label: grads[label]})  # noqa: E731
                    pull = lambda: client.pull([label]).result()  # noqa: E731
                m = out[label]
                # Both pipelined (window in flight) and one at a time; the sides alternate order.
                for w, suffix in ((window, ""), (1, "_w1")):
                    sides = ["thread", "process", "ps"] if (r + w) % 2 == 0 else ["ps", "process", "thread"]
                    acked = {}
                    for side in sides:
                        if side == "thread":
                            got = loopback_bandwidth(nbytes, repeats=repeats, warmup=1, window=w)
                            m["loopback_bps" + suffix].append(got["bytes_per_s"])
                            acked[side] = got["acked"]
                        elif side == "process":
                            rows = (ids, row_grads) if label == "sparse" else None
                            bps, acked[side] = echo.bandwidth(nbytes, repeats, w, rows, grads.get(label))
                            raw_applied += 1 + acked[side]
                            m["process_loopback_bps" + suffix].append(bps)
                        else:
                            push().result()
                            seconds, acked[side] = _pipelined(push, repeats, w)
                            pushes[label] += 1 + acked[side]
                            m["push_bps" + suffix].append(nbytes * acked[side] / seconds)
                    if set(acked.values()) != {repeats}:
                        problems.append(
                            f"{label} round {r} window {w}: messages acknowledged {acked}, "
                            f"expected {repeats} on every side"
                        )
                for _ in range(repeats):
                    started = time.perf_counter()
                    pull()
                    m["pull_s"].append(time.perf_counter() - started)
                m["nbytes"] = nbytes
        # The same-work check on the servers: every acknowledged push was applied exactly once.
        values = client.pull(list(DENSE_SIZES)).result()
        for label in DENSE_SIZES:
            if not torch.equal(values[label], -pushes[label] * grads[label]):
                problems.append(
                    f"{label}: server value != -{pushes[label]} pushes x gradient "
                    f"(max error {float((values[label] + pushes[label] * grads[label]).abs().max()):.3g})"
                )
        if not torch.equal(client.pull_rows("rows", ids).result(), -pushes["sparse"] * row_grads):
            problems.append(f"sparse: the pushed rows != -{pushes['sparse']} pushes x row gradients")
    if echo.close() != raw_applied:
        problems.append(f"raw echo applied a different number of messages than it acknowledged ({raw_applied})")
    for label, m in out.items():
        for suffix in ("", "_w1"):
            # Same work: only the process side crosses a process boundary, as a push does, and
            # applies what it receives (the thread side moves the bytes within this process and
            # applies nothing; shown as context, and as the old ratio to the faster raw side).
            raw = m["process_loopback_bps" + suffix]
            ratios = [p / b for p, b in zip(m["push_bps" + suffix], raw)]
            m["push_to_loopback" + suffix] = statistics.median(ratios)
            m["push_to_loopback_ci95" + suffix] = ci95(ratios)
            faster = [max(a, b) for a, b in zip(m["loopback_bps" + suffix], raw)]
            m["push_to_faster_raw" + suffix] = statistics.median(p / b for p, b in zip(m["push_bps" + suffix], faster))
        m["push_per_s"] = statistics.median(m["push_bps"]) / m["nbytes"]
        m["push_MBps"] = statistics.median(m["push_bps"]) / MB
        m["loopback_MBps"] = statistics.median(m["loopback_bps"]) / MB
        m["process_loopback_MBps"] = statistics.median(m["process_loopback_bps"]) / MB
        m["pull_p50_ms"], m["pull_p99_ms"] = 1e3 * pct(m["pull_s"], 0.5), 1e3 * pct(m["pull_s"], 0.99)
    return {
        "sizes": out,
        "window": window,
        "repeats": repeats,
        "rounds": rounds,
        "pushes_applied": pushes,
        "same_work": not problems,
        "problems": problems,
    }
