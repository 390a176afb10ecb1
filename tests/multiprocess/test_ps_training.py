"""Parameter-server training on real server processes (LocalCluster) and worker processes.

Plain SGD makes the servers' result checkable exactly: whatever the interleaving, the final
value is the initial value minus lr times the sum of every gradient any worker pushed.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pickle
import time
import traceback

import pytest
import torch

from trainmesh.ps.client import PSClient
from trainmesh.ps.cluster import AdminConnection, LocalCluster, rebalance
from trainmesh.ps.errors import PSAuthError
from trainmesh.ps.protocol import MessageType
from trainmesh.ps.shard import init_rows

pytestmark = [pytest.mark.dist, pytest.mark.timeout(90)]

LR = 0.05
SGD = {"name": "sgd", "lr": LR}
SECRET = "ps-training-test-secret"  # the workers are separate processes: one fixed secret for all


def _initial_params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(16, 8, generator=generator), "b": torch.randn(16, generator=generator)}


def _entry(fn, results, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        # Plain pickle: a tensor through the queue would travel as shared memory that dies with us.
        results.put(("ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - the test reports it
        results.put(("error", traceback.format_exc()))


def worker_context():
    """Fresh processes forked from a server that imported torch and trainmesh once: spawning
    each worker would re-import them (seconds each on a loaded machine)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "trainmesh.ps.client", "trainmesh.ps.transport"])
    return ctx


def run_workers(fn, argss: list[tuple], timeout: float = 60.0) -> list:
    """Run ``fn(*args)`` in one process per args; their results in order."""
    ctx = worker_context()
    queues = [ctx.Queue() for _ in argss]
    processes = [ctx.Process(target=_entry, args=(fn, q, args), daemon=True) for q, args in zip(queues, argss)]
    for p in processes:
        p.start()
    try:
        results = []
        for q in queues:
            status, value = q.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"a worker failed:\n{value}")
            results.append(pickle.loads(value))
        return results
    finally:
        for p in processes:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _client(rank, addresses, fault=None, **kwargs) -> PSClient:
    if fault is None:
        return PSClient(servers=addresses, worker_id=rank, part_numel=32, secret=SECRET, **kwargs)
    from trainmesh.ps.inprocess_transport import FaultInjectingTransport
    from trainmesh.ps.transport import ZmqClientTransport

    transports = [
        FaultInjectingTransport(ZmqClientTransport(a, f"w{rank}-{i}".encode()), seed=rank * 7 + i, **fault)
        for i, a in enumerate(addresses)
    ]
    return PSClient(
        transports=transports,
        server_ids=list(addresses),
        worker_id=rank,
        part_numel=32,
        secret=SECRET,
        retry_after_s=0.1,
        **kwargs,
    )


def _train(rank, addresses, steps, mode, staleness, fault, slow_rank):
    """Linear regression on this worker's data; returns what it pushed and what it saw."""
    client = _client(rank, addresses, fault)
    started = time.monotonic()
    params = _initial_params()
    client.init(
        [{"name": n, "kind": "dense", "value": v, "mode": mode, "staleness": staleness} for n, v in params.items()],
        optimizer=SGD,
    )
    generator = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(32, 8, generator=generator), torch.randn(32, 16, generator=generator)
    pushed = {n: torch.zeros_like(v) for n, v in params.items()}
    for _ in range(steps):
        values = client.pull(["w", "b"]).result(30)
        w, b = values["w"].requires_grad_(), values["b"].requires_grad_()
        torch.nn.functional.mse_loss(x @ w.T + b, y).backward()
        grads = {"w": w.grad, "b": b.grad}
        client.push(grads)
        for n in pushed:
            pushed[n] += grads[n]
        if rank == slow_rank:
            time.sleep(0.15)
        client.clock().result(30)
    stats = client.stats().result(30)
    client.close()
    return {
        "pushed": pushed,
        "pulls": client.pulls,
        "clocks": client.clocks_sent,
        "stats": stats,
        "seconds": time.monotonic() - started,
    }


def _final_values(addresses, mode="async", staleness=None) -> dict[str, torch.Tensor]:
    with PSClient(servers=addresses, worker_id="observer", part_numel=32, secret=SECRET) as observer:
        # The same spec as the workers': acknowledged, nothing changes.
        observer.init(_initial_params(), optimizer=SGD, mode=mode, staleness=staleness)
        return observer.pull(["w", "b"]).result(30)


def _expected(results) -> dict[str, torch.Tensor]:
    return {n: v - LR * sum(r["pushed"][n] for r in results) for n, v in _initial_params().items()}


def run_worker_threads(fn, argss: list[tuple], timeout: float = 60.0) -> list:
    """Like ``run_workers`` with one thread per worker (each its own client and sockets)."""
    with concurrent.futures.ThreadPoolExecutor(len(argss)) as pool:
        return [f.result(timeout) for f in [pool.submit(fn, *args) for args in argss]]


# Worker processes for the clean run; threads (four clients in this process, still talking to
# real server processes over TCP) for the faulty one, to keep it fast on a loaded machine.
@pytest.mark.parametrize(
    "fault,run",
    [(None, run_workers), ({"drop_send": 0.1, "drop_recv": 0.1, "duplicate_send": 0.2}, run_worker_threads)],
    ids=["clean-processes", "drops-and-duplicates-threads"],
)
def test_async_sgd_applies_every_pushed_gradient_exactly_once(fault, run):
    with LocalCluster(2, num_workers=4, secret=SECRET) as cluster:
        results = run(_train, [(r, cluster.addresses, 8, "async", None, fault, None) for r in range(4)])
        final = _final_values(cluster.addresses)
        for name, value in _expected(results).items():
            assert torch.allclose(final[name], value, atol=1e-5), (name, (final[name] - value).abs().max())
        servers = results[0]["stats"]["servers"]
        if fault:
            # Connections authenticate once (ps/session.py). A handshake frame the injector dropped or
            # duplicated leaves frames the server cannot authenticate: they are refused unread, and the
            # client hands over again and resends them, so every push above still counts exactly once.
            # No authenticated request may be refused.
            assert all(s["rejected"] == s["unauthenticated"] for s in servers), servers
        else:
            assert all(s["rejected"] == 0 for s in servers), servers
        print("worker seconds:", [round(r["seconds"], 2) for r in results])
        if fault:
            duplicates = sum(s["duplicates"] for r in results for s in r["stats"]["servers"])
            assert duplicates > 0 and sum(r["stats"]["resends"] for r in results) > 0


def _slowest_clock_at(results, when: float) -> int:
    return min(sum(1 for _, t in r["clocks"] if t <= when) for r in results)


@pytest.mark.parametrize("mode,staleness", [("ssp", 2), ("sync", 0)])
def test_no_worker_reads_more_than_staleness_clocks_ahead_of_the_slowest(mode, staleness):
    with LocalCluster(2, num_workers=3, secret=SECRET) as cluster:
        results = run_workers(_train, [(r, cluster.addresses, 8, mode, staleness, None, 2) for r in range(3)])
        observed = [s["max_staleness_observed"] for r in results for s in r["stats"]["servers"]]
        assert max(observed) == staleness  # the fast workers really ran into the bound
        # From the workers' own records: when a pull at clock c was answered, every worker
        # had already announced clock >= c - staleness.
        for r in results:
            for clock, answered in r["pulls"]:
                assert _slowest_clock_at(results, answered) >= clock - staleness
        final = _final_values(cluster.addresses, mode, staleness)
        for name, value in _expected(results).items():
            assert torch.allclose(final[name], value, atol=1e-5)


def test_rebalancing_moves_only_changed_owners_and_keeps_values_state_and_versions():
    momentum = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    secret = b"rebalance-test-secret"  # every frame is HMAC-signed, across the processes too
    with LocalCluster(2, secret=secret) as cluster:
        two = list(cluster.addresses)
        client = PSClient(servers=two, worker_id=0, part_numel=16, rows_per_shard=64, secret=secret)
        weight = torch.randn(20, 10)
        specs = [
            {"name": "w", "kind": "dense", "value": weight},
            {"name": "emb", "kind": "sparse", "shape": [1000, 4], "init": {"std": 0.1}},
        ]
        client.init(specs, optimizer=momentum)
        reference = torch.optim.SGD(
            [ref := weight.clone().requires_grad_()], **{k: v for k, v in momentum.items() if k != "name"}
        )
        grads = [torch.randn(20, 10) for _ in range(4)]
        ids = torch.arange(0, 1000, 7)
        for g in grads[:3]:
            client.push({"w": g}).result(30)
            client.push_rows("emb", ids, torch.ones(len(ids), 4)).result(30)
            ref.grad = g.clone()
            reference.step()
        before_w = client.pull(["w"]).result(30)["w"]
        before_rows = client.pull_rows("emb", torch.arange(1000)).result(30)
        client.close()

        three = two + [cluster.add_server()]
        moved = rebalance(two, three, secret=secret)
        assert moved and all(new == three[2] for _, new in moved.values())  # only the new server gains
        with AdminConnection([three[2]], secret) as admin:
            listing = admin.ask(0, MessageType.EXPORT, {"list": True}).meta
            assert sorted(listing["shard_ids"]) == sorted(moved)
            # Which shards move depends on the servers' addresses (ports are random), so every moved
            # shard is checked: dense parts and embedding row blocks each took the three pushes.
            exported = admin.ask(0, MessageType.EXPORT, {"shards": sorted(moved)}).meta
            assert sorted(exported["shards"]) == sorted(moved)
            assert all(m["version"] == 3 for m in exported["shards"].values())

        client = PSClient(servers=three, worker_id=0, part_numel=16, rows_per_shard=64, secret=secret)
        client.init(specs, optimizer=momentum)
        assert torch.equal(client.pull(["w"]).result(30)["w"], before_w)
        assert torch.equal(client.pull_rows("emb", torch.arange(1000)).result(30), before_rows)
        client.push({"w": grads[3]}).result(30)  # momentum buffers moved too: the same next step
        ref.grad = grads[3].clone()
        reference.step()
        assert torch.allclose(client.pull(["w"]).result(30)["w"], ref.detach(), atol=1e-6)
        after_w = client.pull(["w"]).result(30)["w"]
        client.close()

        remaining = [three[0], three[2]]
        moved_back = rebalance(three, remaining, secret=secret)
        assert all(old == three[1] for old, _ in moved_back.values())  # only the leaver's shards move
        cluster.stop_server(1)
        with PSClient(servers=remaining, worker_id=0, part_numel=16, rows_per_shard=64, secret=secret) as client:
            client.init(specs, optimizer=momentum)
            assert torch.equal(client.pull(["w"]).result(30)["w"], after_w)
            assert torch.equal(client.pull_rows("emb", torch.arange(1000)).result(30), before_rows)
            assert all(s["rejected"] == 0 for s in client.stats().result(30)["servers"])
        with pytest.raises(PSAuthError, match="authentication failed"):  # a wrong secret is told so
            PSClient(servers=remaining, worker_id=9, secret=b"wrong", request_timeout_s=60.0)
        with AdminConnection(remaining, secret) as admin:  # (the first refusal ends the client: one may count it)
            assert sum(admin.ask(i, MessageType.STATS).meta["unauthenticated"] for i in range(2)) > 0


def test_sparse_traffic_is_proportional_to_the_touched_rows():
    rows, dim, touched = 1_000_000, 16, 100
    with LocalCluster(2) as cluster:  # a secret of its own, made for it
        client = PSClient(servers=cluster.addresses, worker_id=0, heartbeat_s=3600, secret=cluster.secret)
        client.init([{"name": "emb", "kind": "sparse", "shape": [rows, dim], "init": {"std": 0.01}}], optimizer=SGD)
        ids = torch.randperm(rows, generator=torch.Generator().manual_seed(1))[:touched]
        budget = 2 * touched * dim * 4 + 4096  # < 2x the row bytes, plus a fixed header allowance

        sent, received = client.bytes_sent, client.bytes_received
        values = client.pull_rows("emb", ids).result(30)
        assert client.bytes_received - received < budget and client.bytes_sent - sent < budget
        initial = {"kind": "normal", "std": 0.01, "seed": 0}
        expected = torch.stack([init_rows(4096, dim, initial, "emb", i // 4096)[i % 4096] for i in ids.tolist()])
        assert torch.equal(values, expected)

        grads = torch.randn(touched, dim)
        sent, received = client.bytes_sent, client.bytes_received
        client.push_rows("emb", ids, grads).result(30)
        assert client.bytes_sent - sent < budget and client.bytes_received - received < 4096

        assert torch.allclose(client.pull_rows("emb", ids).result(30), expected - LR * grads, atol=1e-7)
        neighbours = ids[ids + 1 < rows] + 1
        neighbours = neighbours[~torch.isin(neighbours, ids)]
        untouched = torch.stack(
            [init_rows(4096, dim, initial, "emb", i // 4096)[i % 4096] for i in neighbours.tolist()]
        )
        assert torch.equal(client.pull_rows("emb", neighbours).result(30), untouched)
        servers = client.stats().result(30)["servers"]
        touched_ranges = len(set((ids // 4096).tolist()) | set((neighbours // 4096).tolist()))
        assert sum(s["shards"] for s in servers) == touched_ranges  # of 245 row ranges
        client.close()
