"""Helpers for testing distributed code on real process groups (shipped for users too).

``trainmesh.testing.fixtures`` holds the pytest fixture for :class:`Cluster`; it is not
imported here, so this package does not need pytest.
"""

from .cluster import Cluster, ClusterUnavailable, Host, LinkCounters, ShapingUnsupported
from .harness import DistributedTestError, run_distributed
from .waiting import wait_for

__all__ = [
    "Cluster",
    "ClusterUnavailable",
    "DistributedTestError",
    "Host",
    "LinkCounters",
    "ShapingUnsupported",
    "run_distributed",
    "wait_for",
]
