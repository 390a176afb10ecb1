"""Local server processes (``LocalCluster``) and moving shards between servers (``rebalance``).

``LocalCluster`` starts K ``python -m trainmesh.ps`` processes on free loopback ports, waits
until each answers a ``stats`` request, and can SIGKILL and restart one (same address, same
directory). Used by ``trainmesh run --servers K`` and the tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from .auth import SECRET_ENV, SECRET_FILE_ENV, as_text, new_secret, resolve_secret
from .client_io import ClientIO
from .placement import HashRing
from .protocol import Message, MessageType
from .durability import DURABILITY


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class AdminConnection:
    """Requests to servers that are not a worker's (no register, no heartbeats, no clock)."""

    def __init__(self, addresses: Sequence[str], secret: bytes | str | None = None, timeout_s: float = 60.0):
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.io = ClientIO(
            self.addresses,
            from_addresses=True,
            identity=f"admin-{os.getpid()}-{time.monotonic_ns()}".encode(),
            sender="admin",
            secret=secret,
            retry_after_s=0.5,
            heartbeat_s=None,
            request_timeout_s=timeout_s,
            server_names=self.addresses,
            clock=lambda: 0,
        )

    def ask(self, index: int, kind: MessageType, meta: dict | None = None, tensors: dict | None = None) -> Message:
        msg = Message(kind, "admin", 0, tensors=tensors or {}, meta=meta or {})
        return self.io.submit([(index, msg)], lambda replies: replies[0]).result(self.timeout_s + 5)

    def close(self) -> None:
        self.io.close()

    def __enter__(self) -> "AdminConnection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def rebalance(
    old_servers: Sequence[str],
    new_servers: Sequence[str],
    *,
    secret: bytes | str | None = None,
    virtual_nodes: int = 64,
    timeout_s: float = 60.0,
) -> dict[str, tuple[str, str]]:
    """Move the shards whose owner changes from the ring of ``old_servers`` to that of
    ``new_servers`` (server ids = addresses, as ``PSClient`` uses them), with values, optimizer
    state and versions. Run it while workers are paused; afterwards workers connect with
    ``new_servers``. Returns ``{shard_id: (old, new)}`` of what moved."""
    new_ring = HashRing(list(new_servers), virtual_nodes)
    everyone = list(dict.fromkeys([*old_servers, *new_servers]))
    index = {address: i for i, address in enumerate(everyone)}
    moved: dict[str, tuple[str, str]] = {}
    with AdminConnection(everyone, secret, timeout_s) as admin:
        params: dict[str, dict] = {}
        held: dict[str, list[str]] = {}
        for server in old_servers:
            listing = admin.ask(index[server], MessageType.EXPORT, {"list": True}).meta
            params.update(listing["params"])
            held[server] = listing["shard_ids"]
        for server, shard_ids in held.items():
            # The old owner is the server that holds the shard (not the old ring's answer), so a
            # shard left on the wrong server by an interrupted rebalance still moves home.
            moving = {sid: (server, new) for sid in shard_ids if (new := new_ring.owner(sid)) != server}
            moved.update(moving)
            if not moving:
                continue
            exported = admin.ask(index[server], MessageType.EXPORT, {"shards": sorted(moving)})
            by_target: dict[str, list[str]] = {}
            for sid, (_, new) in moving.items():
                by_target.setdefault(new, []).append(sid)
            for target, sids in by_target.items():
                metas = {sid: exported.meta["shards"][sid] for sid in sids if sid in exported.meta["shards"]}
                tensors = {k: t for k, t in exported.tensors.items() if k.split("|", 1)[0] in metas}
                _check_ok(admin.ask(index[target], MessageType.IMPORT, {"params": params, "shards": metas}, tensors))
        for server in new_servers:  # every server learns every spec (tables create row ranges lazily)
            _check_ok(admin.ask(index[server], MessageType.IMPORT, {"params": params, "shards": {}}))
        for server, shard_ids in held.items():  # drop the old copies only once every import is acknowledged
            gone = sorted(sid for sid in shard_ids if sid in moved)
            if gone and server in index:
                _check_ok(admin.ask(index[server], MessageType.EXPORT, {"shards": gone, "remove": True, "data": False}))
    return moved


def _check_ok(reply: Message) -> None:
    if reply.type is MessageType.ERROR:
        raise RuntimeError(f"rebalance: a server refused: {reply.meta.get('error')}")


class LocalCluster:
    """K parameter-server processes on this machine, stopped (by pid) on exit; each also stops
    by itself once this process is gone (``--parent-pid``), even after a SIGKILL.

    ``directory``: parent of each server's ``server{i}`` snapshot/WAL directory and log file
    (default: a temporary directory). ``secret`` (default: ``TRAINMESH_PS_SECRET`` or
    ``TRAINMESH_PS_SECRET_FILE``, else a new random one) reaches the servers through their
    environment only; clients need ``cluster.secret``.
    """

    def __init__(
        self,
        num_servers: int,
        num_workers: int = 0,
        *,
        durability: str = "none",
        directory: str | os.PathLike | None = None,
        secret: bytes | str | None = None,
        dead_after_s: float = 10.0,
        drop_dead_workers: bool = False,
        snapshot_every: int = 1000,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 60.0,
        extra_args: Sequence[str] = (),
    ):
        if not isinstance(num_servers, int) or num_servers < 1:
            raise ValueError(f"num_servers must be an int >= 1, got {num_servers!r}")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be 'none', 'snapshot' or 'wal', got {durability!r}")
        given = resolve_secret(secret)
        self.secret: str = as_text(given) if given is not None else new_secret()
        self.num_workers, self.durability, self.host = num_workers, durability, host
        self.startup_timeout_s = startup_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="trainmesh-ps-") if directory is None else None
        self.directory = os.fspath(directory) if directory is not None else self._tmp.name
        self.common_args = [
            "--num-workers",
            str(num_workers),
            "--durability",
            durability,
            "--dead-after-s",
            str(dead_after_s),
            "--snapshot-every",
            str(snapshot_every),
            *(["--drop-dead-workers"] if drop_dead_workers else []),
            *extra_args,
        ]
        self.addresses: list[str] = []
        self.processes: list[subprocess.Popen | None] = []
        try:
            self.add_servers(num_servers)
        except BaseException:
            self.stop()
            raise

    def add_servers(self, count: int = 1) -> list[str]:
        """Start ``count`` more servers (in parallel) on free ports; returns their addresses."""
        first = len(self.addresses)
        for i in range(first, first + count):
            self.addresses.append(f"tcp://{self.host}:{_free_port(self.host)}")
            self.processes.append(None)
            self._launch(i)
        for i in range(first, first + count):
            for attempt in range(5):  # a free port can be taken between probing and binding
                try:
                    self._wait_ready(i)
                    break
                except OSError:
                    if attempt == 4:
                        raise
                    self.addresses[i] = f"tcp://{self.host}:{_free_port(self.host)}"
                    self._launch(i)
        return self.addresses[first:]

    def add_server(self) -> str:
        """Start one more server on a free port; returns its address."""
        return self.add_servers(1)[0]

    def server_dir(self, i: int) -> str:
        return os.path.join(self.directory, f"server{i}")

    def _launch(self, i: int) -> None:
        os.makedirs(self.server_dir(i), exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env.pop(SECRET_FILE_ENV, None)
        env[SECRET_ENV] = self.secret  # (a child's environment is readable by this user only)
        command = [
            sys.executable,
            "-m",
            "trainmesh.ps",
            "--bind",
            self.addresses[i],
            "--server-id",
            self.addresses[i],
            "--dir",
            self.server_dir(i),
            "--parent-pid",
            str(os.getpid()),
            *self.common_args,
        ]
        with open(os.path.join(self.directory, f"server{i}.log"), "ab") as log_file:
            self.processes[i] = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)

    def _wait_ready(self, i: int) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with AdminConnection([self.addresses[i]], self.secret, timeout_s=self.startup_timeout_s) as admin:
            future = admin.io.submit([(0, Message(MessageType.STATS, "admin", 0))])
            while not future.done():
                if self.processes[i].poll() is not None:
                    raise OSError(
                        f"parameter server {i} at {self.addresses[i]} exited with code "
                        f"{self.processes[i].returncode}; log:\n{self.log(i)[-2000:]}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"parameter server {i} at {self.addresses[i]} did not answer within "
                        f"{self.startup_timeout_s}s; log:\n{self.log(i)[-2000:]}"
                    )
                time.sleep(0.05)
            future.result()

    def log(self, i: int) -> str:
        with open(os.path.join(self.directory, f"server{i}.log"), errors="replace") as fh:
            return fh.read()

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` (no final snapshot: a crash)."""
        process = self.processes[i]
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(30)

    def restart(self, i: int) -> None:
        """Start server ``i`` again on its address and directory (after ``kill``)."""
        self.kill(i)
        self._launch(i)
        self._wait_ready(i)

    def stop_server(self, i: int, timeout_s: float = 10.0) -> None:
        """Stop server ``i`` gracefully (SIGTERM: a last snapshot), SIGKILL if it does not exit."""
        process = self.processes[i]
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill(i)

    def stop(self) -> None:
        for i in range(len(self.processes)):
            self.stop_server(i)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
