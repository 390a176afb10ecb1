"""Hosts come from the real rendezvous: a job over 2 network-namespace hosts x 2 processes.

Nothing tells the processes which host they are on (no TRAINMESH_HOST_ID): they share the
machine's host name, and tell hosts apart by the address of the interface gloo uses. The
default then reduces hierarchically, which must move fewer bytes through the hosts' interfaces
than a flat all-reduce (the interface counters say so), and int8's two-phase exchange across
hosts must put on the wire what the byte counter says it sends (plus TCP/IP overhead).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).parent / "topology_job.py"
RDZV_PORT = 29431
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TRAINMESH_TIMEOUT_S": "90"}


@pytest.mark.timeout(200)
def test_hosts_from_the_rendezvous_drive_hierarchy_and_wire_bytes(netns_cluster, tmp_path):
    cluster = netns_cluster(2)
    endpoint = f"{cluster.hosts[0].address}:{RDZV_PORT}"
    procs = [
        host.popen(
            [
                sys.executable,
                "-m",
                "trainmesh",
                "run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(host.index),
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "topo",
                str(JOB),
                "--out",
                str(tmp_path),
            ],
            env=WORKER_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for host in cluster.hosts
    ]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0])
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]

    # Two hosts found from the addresses gloo uses (each namespace host's own address).
    for r in ranks:
        assert sorted(map(sorted, r["hosts"])) == [[0, 1], [2, 3]], r["hosts"]
        assert sorted(i.rsplit("/", 1)[1] for i in r["host_ids"]) == sorted(h.address for h in cluster.hosts)
        assert not r["flat"]["hierarchical"] and r["default"]["hierarchical"] and r["int8"]["hierarchical"]
        for name in ("flat", "default", "int8"):
            assert abs(r[name]["checksum"] - ranks[0][name]["checksum"]) < 1e-6  # one model everywhere

    inter = {name: sum(r[name]["tx"] for r in ranks) for name in ("flat", "default", "int8")}
    # Flat ring of 4 crossing the hosts twice: 2 links x 2 (3/4) x 4P bytes; hierarchical: each
    # process all-reduces a P/2 shard with its peer, 4 x 2 x (1/2) x 2P. Ratio 2/3 + overhead.
    assert inter["default"] < 0.75 * inter["flat"], inter
    # int8 across hosts: what the counter says went over the wire, plus TCP/IP headers and ACKs.
    counted = sum(r["int8"]["wire"] for r in ranks)
    assert counted > 0 and counted <= inter["int8"] <= 1.25 * counted, (counted, inter)
    assert inter["int8"] < 0.35 * inter["default"], inter
