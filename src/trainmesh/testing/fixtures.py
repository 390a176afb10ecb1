"""pytest fixtures for tests that need several hosts (import them into a ``conftest.py``).

>>> # conftest.py
>>> from trainmesh.testing.fixtures import netns_cluster  # noqa: F401   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from .cluster import Cluster, ClusterUnavailable, unavailable_reason


@pytest.fixture
def netns_cluster() -> Iterator[Callable[..., Cluster]]:
    """A factory, ``netns_cluster(num_hosts=2) -> Cluster``; every cluster is removed at teardown.

    Skips the test, with the reason shown in pytest's ``-ra`` summary, where this machine
    cannot create network namespaces (no CAP_NET_ADMIN, no iproute2, not Linux).
    """
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network-namespace cluster: {reason}")
    clusters: list[Cluster] = []

    def make(num_hosts: int = 2) -> Cluster:
        try:
            cluster = Cluster(num_hosts)
        except ClusterUnavailable as exc:
            pytest.skip(f"no network-namespace cluster: {exc}")
        clusters.append(cluster)
        cluster.wait_reachable()
        return cluster

    try:
        yield make
    finally:
        for cluster in clusters:
            cluster.close()
