"""The Slurm source of :func:`trainmesh.runtime.detect_cluster_env`: ``SLURM_PROCID``, ``SLURM_NTASKS``,
the node list and the per-node task count read into a ``ClusterEnv``.

It exists apart from ``cluster_env.py`` because it is one launcher's format, with its own parsing.
"""

from __future__ import annotations

import re
from typing import Mapping

from . import addresses as _addresses
from .cluster_place import ClusterEnv, _int_env


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``node[003-005,9],gpu1`` -> ``node003``."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if m is None:
        raise ValueError(f"Cannot parse Slurm node list. Received: {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def _from_slurm(env: Mapping[str, str]) -> ClusterEnv | None:
    rank = _int_env(env, "SLURM_PROCID")
    world_size = _int_env(env, "SLURM_NTASKS")
    if rank is None or world_size is None:
        return None
    nodelist_var = next((name for name in _SLURM_NODELISTS if env.get(name)), None)
    hosts = _addresses.expand_slurm_nodelist(env[nodelist_var], name=nodelist_var) if nodelist_var else ["127.0.0.1"]
    host = _addresses.env_host(env, ("MASTER_ADDR",)) or hosts[0]
    job_id = _int_env(env, "SLURM_JOB_ID") or 0
    # A port derived from the job id keeps two jobs sharing a node apart.
    port = _addresses.env_port(env, ("MASTER_PORT",)) or 20000 + job_id % 10000
    # SLURM_NTASKS_PER_NODE may read "2(x3)" (2 tasks on each of 3 nodes): its leading count is ours.
    per_node = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE", ""))
    num_nodes = _int_env(env, "SLURM_NNODES") or 1
    local_world = int(per_node.group()) if per_node else max(world_size // num_nodes, 1)
    return ClusterEnv(
        rank=rank,
        world_size=world_size,
        local_rank=_int_env(env, "SLURM_LOCALID") or 0,
        local_world_size=max(local_world, 1),
        node_rank=_int_env(env, "SLURM_NODEID") or 0,
        master_addr=host,
        master_port=port,
        source="slurm",
    )
