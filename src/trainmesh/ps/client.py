"""``PSClient``: a worker's connection to the parameter servers.

API calls split their tensors into shards, group the shards by owning server (one message per
server per call, split only past ``batch_bytes``) and hand the messages to one I/O thread,
which owns every socket (ZeroMQ sockets are not thread-safe). Each call returns a
``concurrent.futures.Future``. The I/O thread numbers requests per server, resends any
unanswered one with the same seq after ``retry_after_s`` (the server's dedup applies it once,
also after a server restart), sends heartbeats and fails requests with no answer for
``request_timeout_s``. See docs/parameter_server.md and the message layout in server.py. The
dense calls (``pull``, ``push``) are in client_dense.py, the sparse-row calls (``pull_rows``,
``push_rows``) in client_rows.py; this module keeps the setup, clocks, stats and shutdown.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Iterable, Mapping, Sequence

from .client_dense import DenseCalls
from .client_io import ClientIO
from .client_rows import SparseRows
from .param_entries import normalize_entry
from .placement import HashRing, Partitioner
from .protocol import Message, MessageType
from .row_routing import RowRouter

DEFAULT_OPTIMIZER = {"name": "sgd", "lr": 0.01}


class PSClient(DenseCalls, SparseRows):
    """One worker's client. ``servers``: addresses (``"tcp://127.0.0.1:5555"``), or ``transports``:
    ready ``ClientTransport`` objects (tests), one per server, in the same order everywhere.

    ``server_ids`` name the servers on the placement ring (default: the addresses, or "0".."K-1"
    for transports); every worker must use the same list. ``compression`` ("fp16", "int8",
    "topk:0.01" or a ``Compressor``) compresses dense pushes, with per-shard error feedback.
    ``secret``: the servers' (default ``TRAINMESH_PS_SECRET`` or ``TRAINMESH_PS_SECRET_FILE``); a
    wrong or missing one fails requests with ``PSAuthError`` at once (see auth.py).
    """

    def __init__(
        self,
        servers: Sequence[str] | None = None,
        *,
        transports: Sequence[Any] | None = None,
        worker_id: int | str = 0,
        num_workers: int | None = None,
        secret: bytes | str | None = None,
        compression: Any = None,
        retry_after_s: float = 1.0,
        heartbeat_s: float = 1.0,
        request_timeout_s: float = 120.0,
        server_ids: Sequence[str] | None = None,
        part_numel: int = 262144,
        rows_per_shard: int = 4096,
        virtual_nodes: int = 64,
        batch_bytes: int = 4 << 20,
        seed: int = 0,
    ):
        if (servers is None) == (transports is None):
            raise ValueError(
                "PSClient needs exactly one of servers=[addresses] or transports=[...], "
                f"got servers={servers!r}, transports={transports!r}"
            )
        endpoints = list(servers if servers is not None else transports)
        if not endpoints or isinstance(servers, str):
            raise ValueError(
                f"PSClient needs a non-empty list of servers, got {servers if servers is not None else transports!r}"
            )
        for label, value in (
            ("retry_after_s", retry_after_s),
            ("heartbeat_s", heartbeat_s),
            ("request_timeout_s", request_timeout_s),
        ):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{label} must be a number > 0, got {value!r}")
        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
            raise ValueError(f"num_workers must be an int >= 1 or None, got {num_workers!r}")
        if server_ids is None:
            server_ids = [str(s) for s in servers] if servers is not None else [str(i) for i in range(len(endpoints))]
        if len(server_ids) != len(endpoints):
            raise ValueError(f"server_ids has {len(server_ids)} entries for {len(endpoints)} servers: {server_ids!r}")
        self.worker_id = str(worker_id)
        self.num_workers = num_workers
        self.server_ids = list(server_ids)
        self.ring = HashRing(self.server_ids, virtual_nodes)
        self.partitioner = Partitioner(part_numel, rows_per_shard)
        self.seed = seed
        self.batch_bytes = batch_bytes
        self.compressor = _make_compressor(compression)
        self.params: dict[str, dict] = {}  # name -> normalized spec (what init sent)
        self.clock_value = 0
        # The last clock every server acknowledged: heartbeats carry this one, never a clock whose
        # pushes may still be in flight (a pipelined clock() does not wait for them).
        self.confirmed_clock = 0
        # Client-side records, to check the SSP bound from outside the servers:
        self.pulls: list[tuple[int, float]] = []  # (clock sent with a pull, monotonic time it was answered)
        self.clocks_sent: list[tuple[int, float]] = []  # (new clock, monotonic time before announcing it)
        self._push_futures: set[Future] = set()
        self._push_lock = threading.Lock()
        self._index = {sid: i for i, sid in enumerate(self.server_ids)}
        self._owner_cache: dict[str, int] = {}  # the ring never changes for a client: hash each shard once
        self._shard_cache: dict[tuple[str, int], list] = {}  # (name, numel) -> partitioner parts
        self._routers: dict[str, RowRouter] = {}  # table -> its ranges' owners (row_routing.py)
        identity = f"w{self.worker_id}-{uuid.uuid4().hex[:10]}".encode()
        self.io = ClientIO(
            endpoints,
            from_addresses=servers is not None,
            identity=identity,
            sender=self.worker_id,
            secret=secret,
            retry_after_s=retry_after_s,
            heartbeat_s=heartbeat_s,
            request_timeout_s=request_timeout_s,
            server_names=self.server_ids,
            clock=lambda: self.confirmed_clock,
        )
        try:
            self.register().result(timeout=request_timeout_s + 5)
        except BaseException:
            self.io.close()
            raise

    # -- setup ------------------------------------------------------------------------------

    def register(self) -> Future:
        # The job's worker count lets a server started without one (``--num-workers 0``) wait for
        # every worker before its first sync round closes, not only for those that registered.
        meta = (
            {"worker": self.worker_id}
            if self.num_workers is None
            else {"worker": self.worker_id, "num_workers": self.num_workers}
        )
        return self._to_all(MessageType.REGISTER, meta)

    def init(
        self,
        params: Iterable[Mapping[str, Any]] | Mapping[str, Any],
        *,
        optimizer: dict | None = None,
        mode: str = "async",
        staleness: int | None = None,
    ) -> Future:
        """Create parameters on the servers (the first init of a name wins; later ones are acked).

        ``params``: entries ``{"name", "kind": "dense", "value": Tensor, "optimizer", "mode", "staleness"}``
        or ``{"name", "kind": "sparse", "shape": (rows, dim), "init": {"std": s} | {"zeros": True}, ...}``,
        or a mapping ``{name: Tensor}``. Missing optimizer/mode/staleness come from the keywords.
        Waits until every server acknowledged, then returns the (done) future.
        """
        entries = (
            [{"name": k, "kind": "dense", "value": v} for k, v in params.items()]
            if isinstance(params, Mapping)
            else list(params)
        )
        specs, parts = [], []
        for entry in entries:
            spec, value = normalize_entry(
                entry, optimizer or DEFAULT_OPTIMIZER, mode, staleness, self.partitioner.rows_per_shard, self.seed
            )
            specs.append(spec)
            if value is not None:
                for part in self.partitioner.dense_shards(spec["name"], value.numel()):
                    parts.append((part.shard_id, value.reshape(-1)[part.start : part.stop].contiguous()))
        # Every server gets every spec (tables create their row ranges lazily, wherever they
        # land); the dense parts go to their owners, batched like pushes.
        batches = self._batches([(self._owner(sid), {sid: tensor}, {}) for sid, tensor in parts])
        with_parts = {server for server, _ in batches}
        batches += [(i, []) for i in range(len(self.server_ids)) if i not in with_parts]
        messages = [
            (
                server,
                Message(
                    MessageType.INIT,
                    self.worker_id,
                    0,
                    meta={"params": specs},
                    tensors={k: v for _, t, _ in batch for k, v in t.items()},
                ),
            )
            for server, batch in batches
        ]
        future = self.io.submit(messages)
        future.result()
        for spec in specs:
            self.params[spec["name"]] = spec
        return future

    # -- clocks, stats, shutdown ----------------------------------------------------------------

    def clock(self, wait_for_pushes: bool = True) -> Future:
        """Announce one more finished iteration (after this worker's outstanding pushes).
        ``wait_for_pushes=False`` sends it at once: the servers apply it only after those pushes
        (``after_pushes``, see client_io), even when one is dropped and resent."""
        if wait_for_pushes:
            with self._push_lock:
                outstanding = list(self._push_futures)
            for future in outstanding:
                future.result()
        self.clock_value += 1
        value = self.clock_value
        self.clocks_sent.append((value, time.monotonic()))

        def confirmed(_replies: list[Message]) -> None:
            self.confirmed_clock = max(self.confirmed_clock, value)

        return self._to_all(MessageType.CLOCK, {"clock": value}, confirmed)

    def stats(self) -> Future:
        """Future of ``{"worker", "clock", "bytes_sent", "bytes_received", "resends", "servers": [...]}``."""

        def assemble(replies: list[Message]) -> dict[str, Any]:
            return {
                **self.io.counters(),
                "worker": self.worker_id,
                "clock": self.clock_value,
                "servers": [reply.meta for reply in replies],
            }

        return self._to_all(MessageType.STATS, {}, assemble)

    @property
    def bytes_sent(self) -> int:
        return self.io.counters()["bytes_sent"]

    @property
    def bytes_received(self) -> int:
        return self.io.counters()["bytes_received"]

    def request(self, server: int, kind: MessageType, meta: dict | None = None, tensors: dict | None = None) -> Future:
        """Send one request to server ``server`` (index); future of the reply ``Message`` (admin use)."""
        msg = Message(kind, self.worker_id, 0, tensors=tensors or {}, meta=meta or {})
        return self.io.submit([(server, msg)], lambda replies: replies[0])

    def close(self) -> None:
        self.io.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- helpers ----------------------------------------------------------------------------

    def _owner(self, shard_id: str) -> int:
        owner = self._owner_cache.get(shard_id)
        if owner is None:
            owner = self._owner_cache[shard_id] = self._index[self.ring.owner(shard_id)]
        return owner

    def _to_all(self, kind: MessageType, meta: dict, assemble=None) -> Future:
        return self.io.submit(
            [(i, Message(kind, self.worker_id, 0, meta=dict(meta))) for i in range(len(self.server_ids))], assemble
        )

    def _batches(self, items):
        """Group ``(server, tensors, info)`` per server into messages of at most ``batch_bytes``."""
        per_server: dict[int, list[list]] = {}
        for item in items:
            size = sum(t.numel() * t.element_size() for t in item[1].values())
            batches = per_server.setdefault(item[0], [[0]])
            if batches[-1][0] and batches[-1][0] + size > self.batch_bytes:
                batches.append([0])
            batches[-1][0] += size
            batches[-1].append(item)
        return [(server, batch[1:]) for server, batches in per_server.items() for batch in batches]

    def _track_push(self, future: Future) -> Future:
        with self._push_lock:
            self._push_futures.add(future)
        future.add_done_callback(self._untrack_push)  # runs on the I/O thread
        return future

    def _untrack_push(self, future: Future) -> None:
        with self._push_lock:
            self._push_futures.discard(future)

    def _note_pull(self, clock: int) -> None:
        self.pulls.append((clock, time.monotonic()))


def _make_compressor(compression: Any):
    if compression is None or compression == "none":
        return None
    from trainmesh.compression import get_compressor

    compressor = get_compressor(compression)
    if compressor is not None and compressor.name == "powersgd":
        raise ValueError(
            "PSClient compression: powersgd needs an all-reduce of its factors and cannot be "
            "decompressed by a server; use 'fp16', 'bf16', 'int8' or 'topk:<ratio>'. "
            f"Received: {compression!r}"
        )
    return compressor
