"""trainmesh.ft's step in one process, two replica groups as threads under a real Lighthouse (loopback): the
committed update uses the *average* of the groups' gradients (one group's 1s, the other's 3s: both step
with 2s), bucketed across parameters of two dtypes, and both groups end equal and at the same step."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'trainmesh[ft]')")
from torchft.coordination import LighthouseServer  # noqa: E402

from trainmesh.ft import ReplicaGroups, ReplicaGroupSync  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(90)]


def _group(group: int, url: str, results: dict) -> None:
    try:
        torch.manual_seed(group)  # different starting weights: the quorum's init sync makes them equal
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 2), "b": torch.nn.Linear(2, 1).to(torch.float64)})
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        sync = ReplicaGroupSync(
            model,
            optimizer,
            ReplicaGroups(
                replica_group=group, lighthouse=url, min_replicas=2, advertise_host="127.0.0.1", timeout_s=20
            ),
        )
        steps = []
        try:
            while sync.current_step < 2:
                info = sync.begin_step()
                before = {k: v.clone() for k, v in model.state_dict().items()}
                for p in model.parameters():
                    p.grad = torch.full_like(p, 1.0 + 2 * group)  # 1s on group 0, 3s on group 1
                committed = sync.finish_step()
                steps.append((info.step, info.num_replicas, committed))
                if committed:
                    delta = {k: before[k] - v for k, v in model.state_dict().items()}
                    results.setdefault(group, {})[info.step] = delta
            results[f"final{group}"] = {k: v.clone() for k, v in model.state_dict().items()}
            results[f"steps{group}"] = steps
        finally:
            sync.shutdown()
    except Exception as error:  # surfaced by the test
        results[f"error{group}"] = error


def test_committed_update_is_the_average_over_groups():
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500, heartbeat_timeout_ms=3000)
    url = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    results: dict = {}
    try:
        threads = [threading.Thread(target=_group, args=(g, url, results)) for g in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        lighthouse.shutdown()
    assert not [k for k in results if str(k).startswith("error")], results
    assert results["steps0"] == results["steps1"] == [(0, 2, True), (1, 2, True)]
    for group in (0, 1):
        for step, delta in results[group].items():
            # lr 1: the update is the averaged gradient, 2 (not 4, a sum; not 1 or 3, one group's); float32
            # weights minus (weights - 2) round to within 1e-6 of 2
            assert all(torch.allclose(d, torch.full_like(d, 2.0), rtol=0, atol=1e-6) for d in delta.values()), delta
    assert all(torch.equal(results["final0"][k], results["final1"][k]) for k in results["final0"])
