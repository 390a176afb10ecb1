"""The ``TF_CONFIG`` source of :func:`trainmesh.runtime.detect_cluster_env`: a TensorFlow cluster spec
(``{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}``) read into a
``ClusterEnv``, every role's addresses checked, a malformed spec refused with the shape expected.

It exists apart from ``cluster_env.py`` because it is one launcher's format, with its own checks.
"""

from __future__ import annotations

import json
from typing import Mapping

from . import addresses as _addresses
from .cluster_place import DEFAULT_PORT, ClusterEnv

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
