"""A job across 2 hosts (network namespaces), launched on each as on real machines.

`trainmesh run --nnodes 2 --nproc-per-node 2 --rdzv-endpoint 198.18.0.1:PORT` runs in each
host; torchrun's c10d rendezvous forms one job of 4 processes, and gloo's traffic between
the hosts crosses the veth links (the interface counters must show it). The same job on one
host (4 processes on loopback) is the reference: DDP, ZeRO-3 and a tensor layout
(ModelParallel on a 2 x 2 data x model mesh) must end with the same parameters, within 1e-6
in fp32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
JOB = HERE / "dp_job.py"
sys.path.insert(0, str(HERE))
from dp_job import EPOCHS, GLOBAL_BATCH, N, RUNS, Net  # noqa: E402

PARITY_TOL = 1e-6  # fp32, same ranks and reduction order: expected to be exact, allowed float noise
RDZV_PORT = 29400  # inside the cluster's private network; no other job can hold it

WORKER_ENV = {"OMP_NUM_THREADS": "1", "TRAINMESH_TIMEOUT_S": "90"}


def _launch_cmd(*run_args: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "trainmesh", "run", *run_args, str(JOB), "--out", str(out)]


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outputs.append(out)
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, f"launcher exited {proc.returncode}:\n{out[-4000:]}"
    return outputs


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.timeout(60)
def test_each_host_routes_to_the_rendezvous_host_through_its_own_address(netns_cluster):
    cluster = netns_cluster(2)
    probe = (
        "from trainmesh.launcher.run import choose_local_addr as c\n"
        "print(c('198.18.0.1:29400'))\n"
        "try:\n    c('203.0.113.7:29400')\nexcept ValueError as e:\n    print(e)\n"
    )
    for host in cluster.hosts:
        chosen, refusal = host.run([sys.executable, "-c", probe]).stdout.splitlines()
        assert chosen == host.address
        # No default route in a host: an address outside the cluster is refused, nothing is sent.
        assert refusal.startswith("no route from this machine to the rendezvous host")


@pytest.mark.timeout(360)
def test_dp_zero3_and_tensor_layout_on_two_hosts_equal_one_host(netns_cluster, tmp_path):
    ref_out, multi_out = tmp_path / "one_host", tmp_path / "two_hosts"
    ref_out.mkdir()
    multi_out.mkdir()

    # Reference: all 4 processes on one host, loopback only (standalone rendezvous).
    reference = subprocess.Popen(
        _launch_cmd("-n", "4", out=ref_out),
        env={**os.environ, **WORKER_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _finish([reference], timeout=150)

    cluster = netns_cluster(2)
    before = [host.counters() for host in cluster.hosts]
    endpoint = f"{cluster.hosts[0].address}:{RDZV_PORT}"
    launchers = [
        host.popen(
            _launch_cmd(
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(host.index),
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "parity",
                out=multi_out,
            ),
            env=WORKER_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for host in cluster.hosts
    ]
    outputs = _finish(launchers, timeout=150)
    traffic = [host.counters() - start for host, start in zip(cluster.hosts, before)]

    # Each node advertised its own interface address, not the shared host name.
    for host, out in zip(cluster.hosts, outputs):
        assert f"this node advertises {host.address}" in out
    ranks = [json.loads((multi_out / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["world_size"] for r in ranks} == {4}
    assert sorted(r["node_rank"] for r in ranks) == [0, 0, 1, 1]
    assert {r["master_addr"] for r in ranks} <= {h.address for h in cluster.hosts}
    assert {r["gloo_ifname"] for r in ranks} == {"eth0"}

    # Gradients really crossed the link: to hold the sum, each host must receive at least the
    # other host's gradient (all parameters, fp32) at every DDP step.
    num_params = sum(p.numel() for p in Net().parameters())
    dp_floor = (N // GLOBAL_BATCH) * EPOCHS * num_params * 4
    for t in traffic:
        assert t.rx_bytes >= dp_floor and t.tx_bytes >= dp_floor, (traffic, dp_floor)

    for name, (model_class, _) in RUNS.items():
        one = torch.load(ref_out / f"final_{name}.pt")
        two = torch.load(multi_out / f"final_{name}.pt")
        assert _max_abs_diff(one, model_class().state_dict()) > 1e-3  # it trained
        diff = _max_abs_diff(one, two)
        print(
            f"{name}: max |two hosts - one host| = {diff:.3g}; bytes host0 rx/tx "
            f"{traffic[0].rx_bytes}/{traffic[0].tx_bytes}"
        )
        assert diff <= PARITY_TOL, (name, diff)

    # The same DDP job started as a Slurm step and as a Kubeflow PyTorchJob would start it, on
    # the same hosts (both jobs at once: they share nothing), against the same one-host reference.
    jobs = {}
    for how, launch in (("slurm", _launch_as_srun), ("pytorchjob", _launch_as_pytorchjob)):
        (tmp_path / how).mkdir()
        jobs[how] = launch(cluster, tmp_path / how)
    for how, procs in jobs.items():
        _finish(procs, timeout=200)
        out = tmp_path / how
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        assert [(r["world_size"], r["node_rank"]) for r in ranks] == [(4, 0), (4, 0), (4, 1), (4, 1)], (how, ranks)
        assert {r["master_addr"] for r in ranks} == {cluster.hosts[0].address}, (how, ranks)
        diff = _max_abs_diff(torch.load(ref_out / "final_dp.pt"), torch.load(out / "final_dp.pt"))
        print(f"dp as {how}: max |two hosts - one host| = {diff:.3g}")
        assert diff <= PARITY_TOL, (how, diff)


def _launch_as_srun(cluster, out: Path) -> list[subprocess.Popen]:
    """`srun --nodes 2 --ntasks-per-node 2 python dp_job.py`: one process per task, no launcher;
    trainmesh.initialize reads Slurm's variables (the first host of the node list serves the
    store on 20000 + job id % 10000). The hosts share one host name that resolves to no cluster
    address, so gloo is told its interface, as on machines whose names resolve elsewhere."""
    procs = []
    for host in cluster.hosts:
        for local in range(2):
            env = {
                **WORKER_ENV,
                "SLURM_JOB_ID": "4242",
                "SLURM_NTASKS": "4",
                "SLURM_NNODES": "2",
                "SLURM_NTASKS_PER_NODE": "2",
                "SLURM_NODEID": str(host.index),
                "SLURM_LOCALID": str(local),
                "SLURM_PROCID": str(2 * host.index + local),
                "SLURM_STEP_NODELIST": "198.18.0.[1-2]",
                "GLOO_SOCKET_IFNAME": "eth0",
            }
            procs.append(
                host.popen(
                    [sys.executable, str(JOB), "--out", str(out), "--runs", "dp"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
    return procs


def _launch_as_pytorchjob(cluster, out: Path) -> list[subprocess.Popen]:
    """A PyTorchJob with 2 pods and nprocPerNode 2: each pod runs `trainmesh run -n 2 dp_job.py`
    with the operator's PET_* variables, which trainmesh run reads as torchrun does."""
    master = cluster.hosts[0].address
    return [
        host.popen(
            _launch_cmd("-n", "2", out=out) + ["--runs", "dp"],
            env={
                **WORKER_ENV,
                "PET_NNODES": "2",
                "PET_NODE_RANK": str(host.index),
                "PET_MASTER_ADDR": master,
                "PET_MASTER_PORT": "23456",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for host in cluster.hosts
    ]
