"""Real failures: a server SIGKILLed mid-training and restarted from its WAL; a worker SIGKILLed."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from trainmesh.ps.client import PSClient
from trainmesh.ps.cluster import LocalCluster
from trainmesh.ps.errors import PSTimeoutError

pytestmark = [pytest.mark.dist, pytest.mark.timeout(90), pytest.mark.xdist_group("serial")]

SGD = {"name": "sgd", "lr": 0.1}


def test_server_sigkill_loses_no_acknowledged_update_and_applies_in_flight_pushes_once(tmp_path):
    with LocalCluster(2, durability="wal", directory=tmp_path) as cluster:
        client = PSClient(
            servers=cluster.addresses, worker_id=0, part_numel=8, retry_after_s=0.3, secret=cluster.secret
        )
        w0 = torch.randn(64)  # 8 parts over both servers
        client.init({"w": w0}, optimizer=SGD)
        generator = torch.Generator().manual_seed(3)
        grads = [torch.randn(64, generator=generator) for _ in range(30)]
        for g in grads[:10]:
            client.push({"w": g}).result(30)
        acked = client.pull(["w"]).result(30)["w"]

        # The server frozen and killed must own some of w's parts: placement hashes the servers'
        # addresses, whose ports are random, so either one may own all eight.
        owners = {client.ring.owner(part.shard_id) for part in client.partitioner.dense_shards("w", w0.numel())}
        victim = next(i for i, address in enumerate(cluster.addresses) if str(address) in owners)
        in_flight = [client.push({"w": g}) for g in grads[10:20]]  # not waited for: some may be applied, unacked
        # Frozen, the victim cannot answer the rest: however fast the first ten went through, the kill
        # below is sure to catch pushes in flight (sent, queued at the server, not acknowledged).
        os.kill(cluster.processes[victim].pid, signal.SIGSTOP)
        in_flight += [client.push({"w": g}) for g in grads[20:]]
        cluster.kill(victim)  # SIGKILL while those are on the wire / in its queue
        unacked_at_kill = sum(not f.done() for f in in_flight)
        cluster.restart(victim)  # same address, same WAL directory
        for future in in_flight:
            future.result(60)  # resent with the same seq until the restarted server acks

        final = client.pull(["w"]).result(30)["w"]
        assert torch.allclose(final, w0 - 0.1 * torch.stack(grads).sum(0), atol=1e-5)  # each exactly once
        assert unacked_at_kill >= 10  # the kill really caught pushes in flight (at least the frozen ten)
        stats = client.stats().result(30)
        restarted = stats["servers"][victim]
        assert restarted["replayed"] > 0  # its state came back from the log, not from nowhere
        assert stats["resends"] > 0
        assert not torch.equal(acked, final)
        client.close()


def _victim(addresses, secret, ready, steps_before_ready):
    torch.set_num_threads(1)
    client = PSClient(servers=addresses, worker_id=1, heartbeat_s=0.2, secret=secret)
    client.init(_params(), optimizer=SGD)
    ready.put("started")
    step = 0
    while True:  # until SIGKILLed
        client.pull(["s", "a"]).result(60)
        client.push({"s": torch.ones(4), "a": torch.ones(4)})
        client.clock().result(60)
        step += 1
        if step == steps_before_ready:
            ready.put(step)


def _params():
    return [
        {"name": "s", "kind": "dense", "value": torch.zeros(4), "mode": "sync"},
        {"name": "a", "kind": "dense", "value": torch.zeros(4), "mode": "async"},
    ]


def test_a_killed_worker_stops_sync_with_its_name_while_async_goes_on():
    with LocalCluster(1, num_workers=2, dead_after_s=4.0) as cluster:
        ctx = multiprocessing.get_context("forkserver")  # forked from a process that imported torch once
        ctx.set_forkserver_preload(["torch", "trainmesh.ps.client"])
        ready = ctx.Queue()
        victim = ctx.Process(target=_victim, args=(cluster.addresses, cluster.secret, ready, 3), daemon=True)
        victim.start()
        try:
            survivor = PSClient(servers=cluster.addresses, worker_id=0, heartbeat_s=0.2, secret=cluster.secret)
            survivor.init(_params(), optimizer=SGD)
            assert ready.get(timeout=60) == "started"  # (dead_after_s may be shorter than a process start)
            for _ in range(3):  # lockstep with the victim on the sync parameter
                survivor.pull(["s", "a"]).result(60)
                survivor.push({"s": torch.ones(4), "a": torch.ones(4)})
                survivor.clock().result(60)
            ready.get(timeout=60)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)

            for _ in range(5):  # async parameters never wait for anybody
                survivor.pull(["a"]).result(10)
                survivor.push({"a": torch.ones(4)}).result(10)
                survivor.clock().result(10)
            started = time.monotonic()
            with pytest.raises(PSTimeoutError, match="sync: worker 1 sent no heartbeat") as caught:
                survivor.pull(["s"]).result(30)
            assert caught.value.worker == "1"
            assert time.monotonic() - started < 15
            clocks = survivor.stats().result(10)["servers"][0]["clocks"]
            assert clocks["1"]["live"] is False and clocks["0"]["clock"] == 8
            survivor.close()
        finally:
            if victim.is_alive():
                victim.kill()
                victim.join(5)
