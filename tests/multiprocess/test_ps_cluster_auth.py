"""A default ``LocalCluster`` (no secret given: it makes one) authenticates on loopback: a local
stranger's SHUTDOWN, pushes and exports are refused within seconds and change nothing."""

from __future__ import annotations

import time

import pytest
import torch

from trainmesh.ps.client import PSClient
from trainmesh.ps.cluster import AdminConnection, LocalCluster
from trainmesh.ps.errors import PSAuthError
from trainmesh.ps.protocol import MessageType

pytestmark = [pytest.mark.dist, pytest.mark.timeout(90), pytest.mark.xdist_group("serial")]


def test_a_default_local_cluster_refuses_a_strangers_shutdown_push_and_export(monkeypatch):
    monkeypatch.delenv("TRAINMESH_PS_SECRET", raising=False)
    monkeypatch.delenv("TRAINMESH_PS_SECRET_FILE", raising=False)
    with LocalCluster(1, num_workers=1) as cluster:
        assert len(cluster.secret) >= 40  # made for this cluster
        with PSClient(servers=cluster.addresses, worker_id=0, secret=cluster.secret) as owner:
            owner.init({"w": torch.zeros(4)}, optimizer={"name": "sgd", "lr": 1.0})
            for secret in (None, "a-guess"):
                started = time.monotonic()
                with AdminConnection(cluster.addresses, secret, timeout_s=60) as stranger:
                    for kind, meta in [(MessageType.SHUTDOWN, {}), (MessageType.EXPORT, {"list": True})]:
                        with pytest.raises(PSAuthError, match="authentication failed"):
                            stranger.ask(0, kind, meta)
                with pytest.raises(PSAuthError, match="authentication failed"):
                    stranger_client = PSClient(servers=cluster.addresses, worker_id=9, secret=secret)
                    stranger_client.push({"w": torch.ones(4)}).result(30)
                assert time.monotonic() - started < 10.0  # three refusals, each at once (not the 60 s timeout)
            assert cluster.processes[0].poll() is None  # still serving
            assert torch.equal(owner.pull(["w"]).result(30)["w"], torch.zeros(4))
            stats = owner.stats().result(30)["servers"][0]
            assert stats["unauthenticated"] >= 6 and stats["applied_pushes"] == 0
