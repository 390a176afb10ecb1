"""Sync rounds on an in-process server (ps/sync_rounds.py): a sync parameter's pushes wait for
their round and are applied once, summed; open rounds survive a crash (log and snapshot)."""

from __future__ import annotations

import threading

import pytest
import torch

from trainmesh.ps.client import PSClient
from trainmesh.ps.inprocess_transport import InProcessHub
from trainmesh.ps.server import ParameterServer

pytestmark = pytest.mark.timeout(60)

MOMENTUM = {"name": "sgd", "lr": 1.0, "momentum": 0.9}


class OneServer:
    def __init__(self, **kwargs):
        self.hub, self.kwargs = InProcessHub(), kwargs
        self.start()

    def start(self) -> None:
        self.server = ParameterServer(self.hub.server("s0"), server_id="s0", num_workers=2, **self.kwargs)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def crash(self) -> None:
        """Stop without the graceful last snapshot (what SIGKILL leaves behind)."""
        server = self.server
        server.state.close = lambda: server.state.store and server.state.store.close()
        server.stop()
        self.thread.join(5)
        server.transport.close()

    def client(self, worker: int) -> PSClient:
        return PSClient(
            transports=[self.hub.client("s0", f"w{worker}".encode())],
            worker_id=worker,
            retry_after_s=0.1,
            heartbeat_s=0.1,
        )

    def close(self) -> None:
        self.server.stop()
        self.thread.join(5)
        self.server.transport.close()


def _reference(w0: torch.Tensor, rounds: list[list[torch.Tensor]]) -> torch.Tensor:
    """One process: one momentum step per round on the round's summed gradient."""
    p = w0.clone().requires_grad_()
    optimizer = torch.optim.SGD([p], lr=1.0, momentum=0.9)
    for grads in rounds:
        p.grad = torch.stack(grads).sum(0)
        optimizer.step()
    return p.detach()


def test_sync_pushes_wait_for_their_round_and_are_applied_once_summed():
    servers = OneServer()
    clients = [servers.client(w) for w in range(2)]
    w0 = torch.randn(5)
    for c in clients:
        c.init([{"name": "w", "kind": "dense", "value": w0, "mode": "sync"}], optimizer=MOMENTUM)
    rounds = [[torch.randn(5) for _ in clients] for _ in range(3)]
    for k, grads in enumerate(rounds):
        for c, g in zip(clients, grads):
            c.push({"w": g}).result(10)
        stats = clients[0].stats().result(10)["servers"][0]
        assert stats["open_round_pushes"] == 2 and stats["rounds_applied"] == k  # waiting: nothing applied
        clients[0].clock().result(10)
        assert clients[0].stats().result(10)["servers"][0]["rounds_applied"] == k  # one worker is not a round
        clients[1].clock().result(10)
        for c in clients:  # a sync pull at the next clock sees the whole round, applied once
            torch.testing.assert_close(
                c.pull(["w"]).result(10)["w"], _reference(w0, rounds[: k + 1]), rtol=0, atol=1e-6
            )
    assert clients[0].stats().result(10)["servers"][0]["rounds_applied"] == 3
    for c in clients:
        c.close()
    servers.close()


@pytest.mark.parametrize(
    "durability,snapshot_every",
    [("wal", 1000), ("wal", 1), ("snapshot", 1)],
    ids=["wal-replay", "wal-snapshot-with-open-round", "snapshot-with-open-round"],
)
def test_an_open_round_survives_a_crash(tmp_path, durability, snapshot_every):
    servers = OneServer(durability=durability, directory=tmp_path, snapshot_every=snapshot_every)
    clients = [servers.client(w) for w in range(2)]
    w0 = torch.randn(5)
    for c in clients:
        c.init([{"name": "w", "kind": "dense", "value": w0, "mode": "sync"}], optimizer=MOMENTUM)
    rounds = [[torch.randn(5) for _ in clients] for _ in range(2)]
    for c, g in zip(clients, rounds[0]):
        c.push({"w": g}).result(10)
    for c in clients:
        c.clock().result(10)
    for c, g in zip(clients, rounds[1]):  # round 1: acknowledged, open (its clocks not sent yet)
        c.push({"w": g}).result(10)
    if snapshot_every == 1:
        servers.server.state.store.snapshot_every_s = 0  # (the loop snapshots after every update)
        assert clients[0].stats().result(10)["servers"][0]["open_round_pushes"] == 2
    servers.crash()
    servers.start()
    restarted = servers.server
    assert restarted.state.rounds.pending_pushes == 2  # the open round came back, not applied
    for c in clients:
        c.clock().result(10)
    for c in clients:
        torch.testing.assert_close(c.pull(["w"]).result(10)["w"], _reference(w0, rounds), rtol=0, atol=1e-6)
    for c in clients:
        c.close()
    servers.close()


def test_open_rounds_round_trip_through_snapshot_chunks():
    from trainmesh.ps.sync_rounds import OpenRounds

    rounds = OpenRounds()
    for r in (3, 4):
        for sid in ("w#0", "w#1", "b#0"):
            rounds.add_dense(r, sid, torch.randn(4), lr=0.1 * r)
        rounds.add_rows(r, "emb", torch.tensor([1, 5]), torch.randn(2, 3), lr=None)
        rounds.add_rows(r, "emb", torch.tensor([5, 9]), torch.randn(2, 3), lr=0.5)
        rounds.count_push(r)
    chunks = rounds.state_chunks(per_chunk=2)
    assert len(chunks) == 7 and all(len(tensors) <= 2 for tensors, _ in chunks)  # 14 tensors
    back = OpenRounds()
    back.load_chunks(chunks[::-1])
    assert back.pending_pushes == 2 and sorted(back.rounds) == [3, 4]
    for r in (3, 4):
        a, b = rounds.rounds[r], back.rounds[r]
        assert a.lr == b.lr and all(torch.equal(a.dense[k], b.dense[k]) for k in a.dense)
        assert all(torch.equal(x, y) for x, y in zip(a.summed_rows("emb"), b.summed_rows("emb")))
