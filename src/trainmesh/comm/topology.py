"""Which processes share a host, learned from the processes themselves (not from a declared layout).

Every process contributes a host identity and one ``all_gather_object`` tells everyone the
whole picture. The identity is, in order of preference:

1. ``TRAINMESH_HOST_ID`` when set (a scheduler or a test can name hosts outright);
2. ``hostname/address``: the host name plus the IPv4 address gloo uses (the interface named by
   ``GLOO_SOCKET_IFNAME``, which ``trainmesh run`` sets on multi-node jobs; otherwise the
   address the host name resolves to). The host name alone is not enough: containers and
   network namespaces on one machine share it, and machines cloned from one image often do
   too; the address alone is not either (every host has 127.0.0.1).

Hosts are numbered in order of their lowest rank. ``host_groups`` builds one intra-host group per
host and one inter-host group per local index (the processes with the same position on their
host), as hierarchical all-reduce needs; it returns None when there is one host or the hosts
hold different numbers of processes (hierarchy then cannot pair every process across hosts).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

HOST_ID_ENV = "TRAINMESH_HOST_ID"
_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """IPv4 address of interface ``name`` (Linux ``SIOCGIFADDR``), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def local_host_id() -> str:
    """This process's host identity (see the module doc)."""
    explicit = os.environ.get(HOST_ID_ENV)
    if explicit:
        return explicit
    hostname = socket.gethostname()
    address = None
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        address = interface_address(ifname)
    if address is None:
        try:
            address = socket.gethostbyname(hostname)
        except OSError:
            address = "?"
    return f"{hostname}/{address}"


@dataclass(frozen=True)
class Topology:
    """``hosts[h]``: the global ranks on host ``h`` (ascending); ``host_of[rank]``: its host index."""

    hosts: tuple[tuple[int, ...], ...]
    host_ids: tuple[str, ...]

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def host_of(self) -> dict[int, int]:
        return {rank: h for h, ranks in enumerate(self.hosts) for rank in ranks}

    @property
    def uniform(self) -> bool:
        return len({len(ranks) for ranks in self.hosts}) == 1

    def describe(self) -> str:
        sizes = [len(r) for r in self.hosts]
        return f"{self.num_hosts} host(s) x {sizes[0] if self.uniform else sizes} process(es)"

    @classmethod
    def from_ids(cls, ids: list[str]) -> "Topology":
        order: dict[str, list[int]] = {}
        for rank, host in enumerate(ids):
            order.setdefault(host, []).append(rank)
        return cls(tuple(tuple(r) for r in order.values()), tuple(order))


def discover(group=None) -> Topology:
    """The job's topology (collective over ``group``, default: the whole job)."""
    world = dist.get_world_size(group)
    ids: list = [None] * world
    dist.all_gather_object(ids, local_host_id(), group=group)
    return Topology.from_ids([str(i) for i in ids])


def _job_timeout() -> timedelta | None:
    # new_group() without a timeout gets torch's 30-minute default rather than the job's.
    try:
        return (
            dist.distributed_c10d._get_default_group()._get_backend(__import__("torch").device("cpu")).options._timeout
        )
    except Exception:  # noqa: BLE001 - private in torch; the default is a safe fallback
        return None


def host_groups(topology: Topology):
    """``(intra_group, inter_group)`` of this process, or None (one host, or unequal hosts).

    Collective: every process of the job calls it, with the same topology.
    """
    if topology.num_hosts < 2 or not topology.uniform:
        return None
    rank, timeout = dist.get_rank(), _job_timeout()
    intra = inter = None
    for ranks in topology.hosts:  # every process creates every group, in the same order
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            intra = group
    for local in range(len(topology.hosts[0])):
        ranks = [host[local] for host in topology.hosts]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            inter = group
    return intra, inter
