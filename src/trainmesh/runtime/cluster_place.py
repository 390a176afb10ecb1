"""``ClusterEnv``: this process's place in the job (rank, world, local layout, coordinator, and which
source said so), validated on construction, plus the integer reading of an environment variable that
every source shares.

It exists apart from ``cluster_env.py`` (the order sources are tried in) so that each source module
(``tf_config_env.py``, ``slurm_env.py``) builds the record without importing the detection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

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


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Environment variable {name} must be an integer. Received: {name}={value!r}") from None
