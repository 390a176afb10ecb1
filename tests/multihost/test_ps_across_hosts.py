"""The parameter server across hosts: servers on host 0, a worker on each of hosts 1 and 2.

* Off loopback a secret is required: binding 198.18.0.1 without one is refused before anything
  listens (the transport's own check, unit-tested in tests/unit/test_ps_transport.py), and
  a client signing with another secret is refused (its frames fail the HMAC check, are counted
  as rejected, and it is told so: an authentication error, not a timeout).
* The workers' links drop packets (`Host.shape(loss=...)`): every push is applied exactly once,
  so the servers end at exactly w0 - lr x (sum of every worker's gradients).
* Every process of the server host is SIGKILLed while pushes are in flight, and the servers are
  started again on the same addresses and write-ahead logs: no acknowledged update is lost and
  the in-flight ones are applied once (the same exact sum).
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainmesh.ps.transport import check_bind_address

HERE = Path(__file__).parent
WORKER = HERE / "ps_worker.py"
sys.path.insert(0, str(HERE))
from ps_worker import SGD, grads, initial  # noqa: E402

SECRET = "multihost-test-secret"
PUSHES = 24
PORTS = (5601, 5602)

pytestmark = pytest.mark.timeout(240)


def start_servers(host, directory: Path) -> list[subprocess.Popen]:
    servers = []
    for index, port in enumerate(PORTS):
        proc = host.popen(
            [
                sys.executable,
                "-m",
                "trainmesh",
                "ps-server",
                "--bind",
                f"{host.address}:{port}",
                "--durability",
                "wal",
                "--dir",
                str(directory / f"server{index}"),
            ],
            env={"TRAINMESH_PS_SECRET": SECRET},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        servers.append(proc)
    for proc, port in zip(servers, PORTS):
        line = proc.stdout.readline()
        assert line.strip() == f"READY tcp://{host.address}:{port}", line + proc.stdout.read()[-2000:]
    return servers


def test_ps_across_hosts_secret_loss_and_server_host_kill(netns_cluster, tmp_path):
    cluster = netns_cluster(3)
    server_host, workers = cluster.hosts[0], cluster.hosts[1:]
    addresses = ",".join(f"tcp://{server_host.address}:{port}" for port in PORTS)

    # No secret, no bind off loopback: refused before anything listens (the servers below get one).
    with pytest.raises(ValueError, match="without a secret"):
        check_bind_address(f"tcp://{server_host.address}:5609", None)

    start_servers(server_host, tmp_path)
    for host in workers:
        host.shape(loss=5.0)
        assert host.loss_applied > 0
    dropped = [host.dropped_packets() for host in workers]
    retransmits = [host.tcp_retransmits() for host in cluster.hosts]
    pushing = [
        host.popen(
            [
                sys.executable,
                str(WORKER),
                "push",
                "--servers",
                addresses,
                "--worker",
                str(i),
                "--pushes",
                str(PUSHES),
                "--out",
                str(tmp_path),
            ],
            env={"TRAINMESH_PS_SECRET": SECRET, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, host in enumerate(workers)
    ]

    # A worker whose last pushes were all acknowledged before the other one got this far may already
    # have exited (cleanly): it wrote its ``inflight`` file first, so only a failed exit is an error.
    deadline = time.monotonic() + 120
    while len(glob.glob(str(tmp_path / "inflight.*"))) < 2:
        assert time.monotonic() < deadline and all(p.poll() in (None, 0) for p in pushing), [
            p.communicate()[0][-2000:] for p in pushing if p.poll() not in (None, 0)
        ]
        time.sleep(0.05)
    killed = server_host.kill()  # the server machine loses power with pushes on the wire
    assert len(killed) == 2
    start_servers(server_host, tmp_path)  # same addresses, same write-ahead logs

    for proc in pushing:
        out, _ = proc.communicate(timeout=150)
        assert proc.returncode == 0, out[-3000:]
    lost = [h.dropped_packets() - d for h, d in zip(workers, dropped)]  # while the pushes ran
    resends = sum(json.loads((tmp_path / f"done.{i}").read_text())["resends"] for i in range(2))

    check = workers[0].run(
        [sys.executable, str(WORKER), "check", "--servers", addresses, "--intruder-secret", "not-the-secret"],
        env={"TRAINMESH_PS_SECRET": SECRET, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    result = json.loads(check.stdout.strip().splitlines()[-1])
    every_grad = torch.stack(grads(0, PUSHES) + grads(1, PUSHES)).sum(0)
    expected = initial() - SGD["lr"] * every_grad
    final = torch.tensor(result["w"])
    print(
        f"max |w - exact sum| = {(final - expected).abs().max().item():.3g}; resends {resends}; "
        f"packets dropped on the workers' links {lost}; TCP segments retransmitted by the server host "
        f"and the workers {[h.tcp_retransmits() - r for h, r in zip(cluster.hosts, retransmits)]}; "
        f"replayed {[s['replayed'] for s in result['servers']]}"
    )
    torch.testing.assert_close(final, expected, rtol=0, atol=1e-5)  # each push exactly once
    assert sum(s["replayed"] for s in result["servers"]) > 0  # state came back from the logs
    # Packets were lost, by the links' own count (either direction). Which side retransmits depends
    # on which packets the loss hit (a worker's data, a server's reply, a bare ACK), so the test
    # reads the drops, not one side's retransmissions.
    assert sum(lost) > 0

    # Another secret: the servers refuse it (a bare rejection, which the client reports as an
    # authentication failure), count its frames as rejected, and change nothing.
    assert result["intruder"] == "refused"
    assert sum(s["rejected"] for s in result["servers_after"]) > sum(s["rejected"] for s in result["servers"])
    torch.testing.assert_close(torch.tensor(result["w_after"]), expected, rtol=0, atol=1e-5)
