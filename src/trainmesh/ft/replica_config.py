"""How a replica group joins the others: ``ReplicaGroups``, checked when it is built (before any
process group, Manager or socket), and where its settings come from when not given."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ReplicaGroups", "torchft_available", "LIGHTHOUSE_ENV", "REPLICA_GROUP_ENV"]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable, so its tools and ours agree
REPLICA_GROUP_ENV = "TRAINMESH_REPLICA_GROUP"


def torchft_available() -> bool:
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


def _is_loopback_url(url: str) -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url if "://" in url else f"http://{url}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(kw_only=True)
class ReplicaGroups:
    """How this process's replica group joins the others.

    ``min_replicas``: a step commits only with at least this many groups in it. ``lighthouse``: the
    Lighthouse URL (default ``$TORCHFT_LIGHTHOUSE``). ``replica_group``: this group's number (default
    ``$TRAINMESH_REPLICA_GROUP``). ``quorum_retries``: at least this many failed quorum calls (a Lighthouse outage)
    are retried before the group gives up; torchft's default, 0, kills every group within 0.2 s of
    losing the Lighthouse. ``lighthouse_retry_s``: during an outage the Lighthouse is tried again about
    this often (the retries are raised to ``quorum_timeout_s / lighthouse_retry_s``), so an outage of up to
    ``quorum_timeout_s`` is survived and the job goes on within about 2 x ``lighthouse_retry_s`` + one
    quorum of the Lighthouse's return, whatever the time-outs. ``advertise_host``: the address peers reach this group at,
    and the only one its Manager server and its store listen on; default 127.0.0.1 when the Lighthouse is
    on loopback (a job on one machine), else this host's name.
    """

    min_replicas: int = 1
    lighthouse: str | None = None
    replica_group: int | None = None
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.1
    quorum_retries: int = 3
    lighthouse_retry_s: float = 1.0
    advertise_host: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"min_replicas must be an int >= 1. Received: min_replicas={self.min_replicas!r}")
        for name in (
            "timeout_s",
            "quorum_timeout_s",
            "connect_timeout_s",
            "heartbeat_interval_s",
            "lighthouse_retry_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0. Received: {name}={getattr(self, name)!r}")
        if self.quorum_retries < 0:
            raise ValueError(f"quorum_retries must be >= 0. Received: quorum_retries={self.quorum_retries!r}")
        if self.lighthouse is None:
            self.lighthouse = os.environ.get(LIGHTHOUSE_ENV)
        if not self.lighthouse:
            raise ValueError(
                f"ReplicaGroups needs the Lighthouse's URL: lighthouse=... or ${LIGHTHOUSE_ENV}. "
                f"Received: lighthouse={self.lighthouse!r}"
            )
        if self.advertise_host is None and _is_loopback_url(self.lighthouse):
            self.advertise_host = "127.0.0.1"  # every group reaches the Lighthouse on loopback: one machine
        if self.replica_group is None and os.environ.get(REPLICA_GROUP_ENV):
            self.replica_group = int(os.environ[REPLICA_GROUP_ENV])
        if not isinstance(self.replica_group, int) or self.replica_group < 0:
            raise ValueError(
                f"replica_group must be an int >= 0 (or ${REPLICA_GROUP_ENV}). "
                f"Received: replica_group={self.replica_group!r}"
            )
