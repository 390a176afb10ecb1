"""Where am I in the job? Detect rank, world size and coordinator, with no networking.

Sources are tried in a fixed order and the first one that applies wins:

1. explicit arguments to :func:`trainmesh.initialize` (Keras signature);
2. ``TRAINMESH_*`` variables, then the torchrun / torchelastic variables
   ``RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT``;
3. a ``TF_CONFIG`` JSON cluster spec
   (``{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}``);
4. Slurm (``SLURM_PROCID SLURM_NTASKS SLURM_LOCALID ...``);
5. nothing: a single process that needs no network at all.

(Under torchrun's elastic agent, ``TORCHELASTIC_RUN_ID`` is set and torchrun's variables
outrank stale ``TRAINMESH_*`` ones. A process group someone else started is adopted as
source ``"existing"``.)

Everything here is a pure function of its arguments and an environment mapping, so it
is unit-tested without starting a single process.

The record lives in ``cluster_place`` and the TF_CONFIG and Slurm sources in ``tf_config_env`` and
``slurm_env``; this module keeps the order they are tried in and the argument and torchrun sources.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from . import addresses as _addresses
from .cluster_place import DEFAULT_PORT, ClusterEnv, _int_env
from .slurm_env import _from_slurm, first_slurm_host
from .tf_config_env import _from_tf_config

__all__ = [
    "DEFAULT_PORT",
    "ClusterEnv",
    "detect_cluster_env",
    "first_slurm_host",
    "parse_address",
    "split_job_addresses",
]


def parse_address(address: str, name: str = "job_addresses") -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> (host, port); a missing port gets the default. An empty
    host or a port outside 1..65535 is a ValueError naming ``name`` and the value."""
    return _addresses.parse_address(address, name=name, default_port=DEFAULT_PORT)


def split_job_addresses(job_addresses: str | Sequence[str] | None) -> list[str]:
    if job_addresses is None:
        return []
    if isinstance(job_addresses, str):
        parts = job_addresses.split(",")
    else:
        parts = list(job_addresses)
    parts = [p.strip() for p in parts if p and p.strip()]
    return parts


def _from_arguments(job_addresses, num_processes, process_id, env) -> ClusterEnv | None:
    addresses = split_job_addresses(job_addresses)
    if not addresses and num_processes is None and process_id is None:
        return None
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1. Received: num_processes={num_processes}")
    # Keras: one address names only the coordinator; several name every process.
    if len(addresses) > 1 and num_processes is not None and len(addresses) != num_processes:
        raise ValueError(
            f"job_addresses lists {len(addresses)} processes but num_processes={num_processes}. "
            f"Received: job_addresses={addresses!r}, num_processes={num_processes}"
        )
    world_size = num_processes if num_processes is not None else max(len(addresses), 1)
    if process_id is None:
        process_id = _int_env(env, "TRAINMESH_RANK")
        if process_id is None:
            process_id = _int_env(env, "RANK")
    if process_id is None:
        if world_size > 1:
            raise ValueError(
                f"process_id is required when num_processes > 1. Received: num_processes={world_size}, process_id=None"
            )
        process_id = 0
    # Every entry is checked (port range, empty host); repeats are not refused: only the first, the
    # coordinator, is ever bound or dialled, and Keras scripts on one host list it once per process.
    parsed = [parse_address(a) for a in addresses]
    if addresses:
        host, port = parsed[0]
    else:
        host = _addresses.env_host(env, ("TRAINMESH_MASTER_ADDR", "MASTER_ADDR")) or "127.0.0.1"
        port = _addresses.env_port(env, ("TRAINMESH_MASTER_PORT", "MASTER_PORT")) or DEFAULT_PORT
    local_rank = _int_env(env, "LOCAL_RANK")
    local_world = _int_env(env, "LOCAL_WORLD_SIZE")
    if local_rank is None:
        # Without a launcher we cannot know the node layout: assume one process per node
        # when addresses name distinct hosts, else all on this host.
        distinct_hosts = len({host for host, _ in parsed}) if len(addresses) > 1 else 1
        if distinct_hosts == world_size and world_size > 1:
            local_rank, local_world = 0, 1
        else:
            local_rank, local_world = process_id, world_size
    return ClusterEnv(
        rank=process_id,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world or 1,
        node_rank=process_id // max(local_world or 1, 1),
        master_addr=host,
        master_port=port,
        source="arguments",
    )


def _from_torchrun(env: Mapping[str, str], prefix: str, source: str) -> ClusterEnv | None:
    world_size = _int_env(env, prefix + "WORLD_SIZE")
    rank = _int_env(env, prefix + "RANK")
    if world_size is None or rank is None:
        return None
    local_rank = _int_env(env, prefix + "LOCAL_RANK")
    local_world = _int_env(env, prefix + "LOCAL_WORLD_SIZE")
    if local_rank is None:
        local_rank, local_world = rank, world_size
    local_world = local_world or world_size
    node_rank = _int_env(env, prefix + "GROUP_RANK")
    if node_rank is None:
        node_rank = _int_env(env, "GROUP_RANK") if prefix else None
    if node_rank is None:
        node_rank = rank // max(local_world, 1)
    return ClusterEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=_addresses.env_host(env, (prefix + "MASTER_ADDR", "MASTER_ADDR")) or "127.0.0.1",
        master_port=_addresses.env_port(env, (prefix + "MASTER_PORT", "MASTER_PORT")) or DEFAULT_PORT,
        source=source,
    )


def detect_cluster_env(
    job_addresses: str | Sequence[str] | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ClusterEnv:
    """Return this process's :class:`ClusterEnv`; raises ValueError on contradictions.

    >>> detect_cluster_env(environ={}).world_size
    1
    >>> detect_cluster_env(environ={"RANK": "1", "WORLD_SIZE": "2"}).rank
    1
    """
    env = os.environ if environ is None else environ
    # Under torchrun's elastic agent its variables describe this very restart of the job, so
    # they outrank TRAINMESH_* values that may linger in the shell that started the launcher.
    under_elastic_agent = "TORCHELASTIC_RUN_ID" in env
    for found in (
        lambda: _from_arguments(job_addresses, num_processes, process_id, env),
        lambda: _from_torchrun(env, "", "torchrun") if under_elastic_agent else None,
        lambda: _from_torchrun(env, "TRAINMESH_", "trainmesh"),
        lambda: _from_torchrun(env, "", "torchrun"),
        lambda: _from_tf_config(env),
        lambda: _from_slurm(env),
    ):
        cluster = found()
        if cluster is not None:
            return cluster
    return ClusterEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=DEFAULT_PORT,
        source="single",
    )
