"""Turn "a collective timed out" into "rank 1 never reached step 7's all-reduce".

Every process notes where it is (step, phase, time) in the job's own c10d store (the one
torch.distributed rendezvoused with; nothing of ours on the network). When a collective fails
(timeout, or a peer's connection closed), the surviving processes read every rank's last note
and raise :class:`CollectiveTimeoutError` naming the ranks that are behind or silent, the step
and the operation, instead of gloo's bare "timed out" or a silent hang.

Each process also notes once which host it runs on (the address it reaches the rendezvous
host from, and its host name), so when every rank of one host is missing the error says that
host was lost, not merely that some ranks are late.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import torch.distributed as dist

_KEY = "trainmesh/progress/{}"
_HOST_KEY = "trainmesh/host/{}"


def host_identity(environ=None) -> tuple[str, str, int]:
    """``(address, host name, node rank)`` of this process as the other hosts know it.

    The address is the one this machine reaches ``MASTER_ADDR`` from (a UDP ``connect`` only
    asks the kernel for a route; nothing is sent), which names a host even where host names
    are shared or resolve to loopback.
    """
    env = os.environ if environ is None else environ
    address = "?"
    master = env.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, int(env.get("MASTER_PORT") or 29500)))
                address = probe.getsockname()[0]
        except (OSError, ValueError):
            pass
    local_world = int(env.get("LOCAL_WORLD_SIZE") or 1)
    node = env.get("GROUP_RANK")
    node_rank = int(node) if node not in (None, "") else int(env.get("RANK") or 0) // max(local_world, 1)
    return address, socket.gethostname(), node_rank


class CollectiveTimeoutError(RuntimeError):
    """A collective failed; ``missing_ranks`` are the processes that did not get there."""

    def __init__(
        self,
        message: str,
        missing_ranks: list[int],
        step: int,
        phase: str,
        lost_hosts: dict[str, list[int]] | None = None,
    ):
        super().__init__(message)
        self.missing_ranks, self.step, self.phase = missing_ranks, step, phase
        # address -> ranks, for hosts none of whose ranks got there (a host lost, not a slow rank)
        self.lost_hosts = lost_hosts or {}


def _default_store():
    try:  # the default group's store: private in torch, so degrade to no diagnosis if it moves
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None


class ProgressBeacon:
    """``mark(step)`` once per step, ``phase = ...`` as the step goes on (local only),
    ``diagnose(error)`` after a collective failed, ``close()`` when training ends.

    The note goes to the store from a writer thread, at most once per ``WRITE_INTERVAL_S`` (the
    newest note; the ones in between are never needed): a step does not wait for a round trip
    to the rendezvous host, and that host's store serves at most a few writes per second per
    rank, however short the steps. ``diagnose`` first waits long enough for every live rank's
    newest note to be written.
    """

    WRITE_INTERVAL_S = 0.25

    def __init__(self, store=None, rank: int | None = None, world_size: int | None = None) -> None:
        """The job's own store, rank and size by default; ``store``, ``rank``, ``world_size`` stand
        in for them (tests: a dict-backed store)."""
        if store is not None:
            self.enabled, self.store, self.rank, self.world_size = True, store, rank, world_size
        else:
            self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            self.store = _default_store() if self.enabled else None
            self.rank = dist.get_rank() if self.enabled else 0
            self.world_size = dist.get_world_size() if self.enabled else 1
        self.step, self.phase, self.since = -1, "start", time.time()
        self._note: str | None = None  # the newest note, not yet written
        self._noted = threading.Event()
        self._writer: threading.Thread | None = None
        self._closed = False
        if self.store is not None:
            try:
                self.store.set(_HOST_KEY.format(self.rank), "|".join(map(str, host_identity())))
            except Exception:  # noqa: BLE001 - a beacon must never break training
                self.store = None

    def mark(self, step: int, phase: str = "step") -> None:
        self.step, self.phase, self.since = step, phase, time.time()
        if self.store is not None and not self._closed:
            self._note = f"{step}|{phase}|{self.since:.3f}"
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_notes, name=f"trainmesh-beacon-{self.rank}", daemon=True
                )
                self._writer.start()
            self._noted.set()

    def _write_notes(self) -> None:
        key, written = _KEY.format(self.rank), None
        while True:
            self._noted.wait()
            self._noted.clear()
            note = self._note  # (notes differ by their time: an unchanged one was written already)
            if note is not None and note != written:
                try:
                    self.store.set(key, note)
                except Exception:  # noqa: BLE001 - a beacon must never break training (the store is gone)
                    self.store = None
                    return
                written = note
            if self._closed:
                return
            time.sleep(self.WRITE_INTERVAL_S)  # notes made meanwhile: only the newest is written next

    def close(self) -> None:
        """Write the last note and stop the writer (the end of ``fit``)."""
        self._closed = True
        if self._writer is not None:
            self._noted.set()
            self._writer.join(timeout=5)
            self._writer = None

    def _read(self) -> dict[int, tuple[int, str, float] | None]:
        seen: dict[int, tuple[int, str, float] | None] = {}
        for rank in range(self.world_size):
            key = _KEY.format(rank)
            try:
                if not self.store.check([key]):
                    seen[rank] = None
                    continue
                step, phase, at = self.store.get(key).decode().split("|", 2)
                seen[rank] = (int(step), phase, float(at))
            except Exception:  # noqa: BLE001
                seen[rank] = None
        return seen

    def _hosts(self) -> dict[int, tuple[str, str, str]]:
        hosts = {}
        for rank in range(self.world_size):
            try:
                address, name, node = self.store.get(_HOST_KEY.format(rank)).decode().split("|", 2)
                hosts[rank] = (address, name, node)
            except Exception:  # noqa: BLE001 - unknown host: reported by rank only
                pass
        return hosts

    def _lost_hosts(self, missing: list[int]) -> tuple[dict[str, list[int]], str]:
        """Hosts all of whose ranks are missing, and a sentence naming them."""
        hosts = self._hosts()
        by_host: dict[tuple[str, str, str], list[int]] = {}
        for rank, where in hosts.items():
            by_host.setdefault(where, []).append(rank)
        lost = {where: ranks for where, ranks in by_host.items() if len(by_host) > 1 and set(ranks) <= set(missing)}
        if not lost:
            return {}, ""
        names = "; ".join(
            f"host {address} (node {node}, host name {name!r}): ranks {ranks}"
            for (address, name, node), ranks in sorted(lost.items())
        )
        return {where[0]: ranks for where, ranks in lost.items()}, f" Lost: {names}."

    def diagnose(self, error: BaseException) -> CollectiveTimeoutError | None:
        """The error to raise instead of ``error``, or None when nothing more can be said."""
        if not self.enabled or self.store is None:
            return None
        # Every live rank writes its newest note within one write interval (and a round trip).
        time.sleep(2 * self.WRITE_INTERVAL_S + 0.1)
        seen = self._read()
        now = time.time()
        # Behind: never reported, or still at an earlier step than this process.
        missing = [r for r, note in seen.items() if r != self.rank and (note is None or note[0] < self.step)]
        if not missing:
            return None
        details = ", ".join(
            f"rank {r}: "
            + ("never reported" if seen[r] is None else f"last started step {seen[r][0]} {now - seen[r][2]:.0f}s ago")
            for r in missing
        )
        lost, lost_text = self._lost_hosts(missing)
        message = (
            f"rank {self.rank}: '{self.phase}' at step {self.step} failed after {now - self.since:.0f}s "
            f"waiting for rank(s) {missing} ({details}).{lost_text} "
            f"Underlying error: {str(error).splitlines()[0][:300]}"
        )
        return CollectiveTimeoutError(message, missing, self.step, self.phase, lost)
