"""Process runtime: detect the cluster, start the process group once, answer who-am-I."""

from .cluster_env import ClusterEnv, detect_cluster_env
from .devices import list_devices, local_torch_device, to_local_device, torch_device_type
from .process_group import (
    DEFAULT_TIMEOUT_S,
    backend,
    barrier,
    cluster_env,
    collective_timeout,
    initialize,
    is_initialized,
    is_main_process,
    local_rank,
    rank,
    shutdown,
    world_size,
)

__all__ = [
    "ClusterEnv",
    "DEFAULT_TIMEOUT_S",
    "backend",
    "barrier",
    "cluster_env",
    "collective_timeout",
    "detect_cluster_env",
    "initialize",
    "is_initialized",
    "is_main_process",
    "list_devices",
    "local_rank",
    "local_torch_device",
    "to_local_device",
    "rank",
    "shutdown",
    "torch_device_type",
    "world_size",
]
