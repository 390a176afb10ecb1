"""What the replica-group tests share: a torchft Lighthouse on loopback, the environment their groups run
in, the groups' step logs (one JSON line per step), and waiting on those logs while watching the groups'
processes, so a group that dies fails the wait at once instead of at its timeout."""

from __future__ import annotations

import json
import os

from trainmesh.testing import wait_for  # noqa: F401  (the ft tests take it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lighthouse_on_loopback(heartbeat_timeout_s: float = 1.5, min_replicas: int = 1):
    """A real Lighthouse on a free loopback port: (server, its URL). The caller shuts the server down."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=min_replicas,
        join_timeout_ms=500,
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )
    return server, f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"


def group_env() -> dict[str, str]:
    """The groups' environment: one thread each, this checkout's trainmesh, torchft's Rust logs at warn."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src"), "RUST_LOG": "warn"}


def records(path) -> list[dict]:
    """A group's step log so far (a line still being written is left out)."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.endswith("\n")]
