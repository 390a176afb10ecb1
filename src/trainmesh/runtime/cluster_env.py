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
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from . import addresses as _addresses

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class ClusterEnv:
    """This process's place in the job, as detected before any connection is made."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str  # "arguments" | "trainmesh" | "torchrun" | "tf_config" | "slurm" | "single" | "existing"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1. Received: world_size={self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in [0, world_size). Received: rank={self.rank}, "
                f"world_size={self.world_size} (from {self.source})"
            )
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise ValueError(
                f"local_rank must be in [0, local_world_size). Received: local_rank={self.local_rank}, "
                f"local_world_size={self.local_world_size} (from {self.source})"
            )

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def init_method(self) -> str:
        return f"tcp://{_bracket_ipv6(self.master_addr)}:{self.master_port}"


def _bracket_ipv6(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


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


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Environment variable {name} must be an integer. Received: {name}={value!r}") from None


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


_TF_CONFIG_SHAPE = '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}'


def _tf_config_error(raw: str, why: str) -> ValueError:
    return ValueError(f"TF_CONFIG {why}; expected JSON like {_TF_CONFIG_SHAPE}. Received: TF_CONFIG={raw!r}")


def _tf_config_members(spec: dict, role: str, raw: str) -> list[tuple[str, int]]:
    entries = spec["cluster"].get(role, [])
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise _tf_config_error(raw, f"cluster.{role} must be a list of 'host:port' strings")
    members = []
    for i, entry in enumerate(entries):
        try:
            members.append(_addresses.split_host_port(entry, DEFAULT_PORT))
        except ValueError as exc:
            raise _tf_config_error(raw, f"has a bad address cluster.{role}[{i}]={entry!r}: {exc}") from None
    return members


def _check_tf_config_addresses(spec: dict, raw: str) -> None:
    """Every role's addresses (ps and evaluator too): well formed, and no address used twice."""
    if not isinstance(spec["cluster"], dict):
        raise _tf_config_error(raw, "cluster must be an object of role -> addresses")
    labelled = []
    for role in spec["cluster"]:
        labelled += [(f"cluster.{role}[{i}]", pair) for i, pair in enumerate(_tf_config_members(spec, role, raw))]
    try:
        _addresses.check_distinct(labelled, name="TF_CONFIG", value=raw)
    except ValueError as exc:
        raise _tf_config_error(raw, str(exc).split(". Received")[0]) from None


def _from_tf_config(env: Mapping[str, str]) -> ClusterEnv | None:
    raw = env.get("TF_CONFIG")
    if not raw:
        return None
    try:
        spec = json.loads(raw)
        spec["cluster"]["worker"]
        task = spec.get("task", {})
        task_type = task.get("type", "worker")
        index = int(task.get("index", 0))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _tf_config_error(raw, f"cannot be read ({type(exc).__name__}: {exc})") from None
    if task_type not in ("worker", "chief"):
        raise _tf_config_error(raw, f"task type {task_type!r} is not a training task (only 'worker' and 'chief' train)")
    _check_tf_config_addresses(spec, raw)
    # A "chief", when present, is rank 0 and the workers follow it (TF's convention).
    chief = _tf_config_members(spec, "chief", raw)
    workers = _tf_config_members(spec, "worker", raw)
    own_list = chief if task_type == "chief" else workers
    if not 0 <= index < len(own_list):
        raise _tf_config_error(raw, f"task index {index} is outside cluster.{task_type} ({len(own_list)} entries)")
    members = chief + workers
    rank = index if task_type == "chief" else len(chief) + index
    my_host = members[rank][0]
    same_host = [i for i, (host, _) in enumerate(members) if host == my_host]
    hosts_in_order = list(dict.fromkeys(host for host, _ in members))
    return ClusterEnv(
        rank=rank,
        world_size=len(members),
        local_rank=same_host.index(rank),
        local_world_size=len(same_host),
        node_rank=hosts_in_order.index(my_host),
        master_addr=members[0][0],
        master_port=members[0][1],
        source="tf_config",
    )


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
