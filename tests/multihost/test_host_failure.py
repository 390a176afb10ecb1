"""A whole host lost mid-epoch, across 2 network-namespace hosts x 2 processes.

Each host runs `trainmesh run --nnodes ... --rdzv-endpoint 198.18.0.1:PORT --max-restarts 2`
(torchrun's c10d rendezvous). The job (host_ft_job.py) checkpoints every 2 steps (sharded,
async) and logs the samples of every step. Host 1's processes stop after step 5; then

* every process of host 1 is SIGKILLed (the machine loses power) and host 1 is started again:
  host 0's launcher restarts its workers, both rendezvous anew, resume from the step-4
  checkpoint, and the final parameters are bit-identical to an uninterrupted run;
* or host 1's cable is cut and it never comes back: with `--nnodes 1:2` host 0 goes on alone
  (2 processes, same global batch), within 1e-5 of the uninterrupted 4-process run.

Both times every sample is trained exactly once per epoch (steps rolled back by the resume
are trained again, and counted once), and the survivors' error names the lost host and its
ranks (trainmesh.comm.diagnosis).
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from trainmesh.testing.cluster import Cluster, ClusterUnavailable, unavailable_reason

HERE = Path(__file__).parent
JOB = HERE / "host_ft_job.py"
N, STEPS_PER_EPOCH, EPOCHS = 96, 6, 2
STALL_AT = 5  # host 1 stops after step 5; the last checkpoint is step 4's
ENV = {"OMP_NUM_THREADS": "1", "TRAINMESH_TIMEOUT_S": "10"}
# A dead node's rendezvous entry expires after 1 s x 3 missed heartbeats (torch's default: 15 s);
# an elastic round closes 2 s after its minimum is there.
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("serial")]


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network-namespace cluster: {reason}")
    try:
        hosts = Cluster(2)
    except ClusterUnavailable as exc:
        pytest.skip(f"no network-namespace cluster: {exc}")
    with hosts:
        hosts.wait_reachable()
        yield hosts


def launch(
    host, out: Path, *, nnodes: str, port: int, job_args: tuple[str, ...] = (), log: str = ""
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "trainmesh",
        "run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "2",
        "--node-rank",
        str(host.index),
        "--rdzv-endpoint",
        f"{host.cluster.hosts[0].address}:{port}",
        "--rdzv-id",
        f"job{port}",
        "--rdzv-conf",
        RDZV_CONF,
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.5",
        str(JOB),
        "--out",
        str(out),
        "--step-sleep",
        "0.1",
        *job_args,
    ]
    logfile = open(out / f"launcher{host.index}{log}.log", "w")
    return host.popen(cmd, env=ENV, stdout=logfile, stderr=subprocess.STDOUT)


def finish(procs, out: Path, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
    logs = "\n".join(Path(p).read_text()[-3000:] for p in sorted(glob.glob(str(out / "launcher*.log"))))
    assert [p.returncode for p in procs] == [0] * len(procs), logs


def wait_for_stall(out: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(glob.glob(str(out / "stalled.rank*"))) < 2:
        assert time.monotonic() < deadline, "host 1 never reached the step it stops after"
        time.sleep(0.2)
    time.sleep(0.5)  # host 0's processes are now inside step 6's gradient all-reduce


def effective_steps(out: Path):
    """({epoch: {step: samples}}, attempts in order, {attempt: world size}), keeping from each
    attempt only the steps the next attempt did not roll back."""
    lines = []
    for name in sorted(glob.glob(str(out / "samples.rank*.log"))):
        lines += [line.split() for line in Path(name).read_text().splitlines() if line.strip()]
    resumes, worlds = {}, {}
    for parts in lines:
        if parts[0] == "RESUME":
            resumes.setdefault(parts[1], int(parts[2]))
            worlds[parts[1]] = int(parts[3])
    order = sorted(resumes, key=resumes.get)
    kept = defaultdict(lambda: defaultdict(list))
    for parts in lines:
        if parts[0] != "STEP":
            continue
        attempt, epoch, step = parts[1], int(parts[2]), int(parts[3])
        later = order[order.index(attempt) + 1 :]
        if later and step > resumes[later[0]]:
            continue  # rolled back: trained again by the next attempt
        kept[epoch][step] += [int(x) for x in parts[4:]]
    return kept, order, {a: worlds[a] for a in order}, resumes


def assert_exactly_once(out: Path):
    kept, order, worlds, resumes = effective_steps(out)
    assert sorted(kept) == list(range(EPOCHS))
    for epoch, steps in kept.items():
        assert len(steps) == STEPS_PER_EPOCH, (epoch, sorted(steps))
        seen = sorted(i for samples in steps.values() for i in samples)
        assert seen == list(range(N)), f"epoch {epoch}: not every sample exactly once"
    return order, worlds, resumes


def assert_lost_host_named(out: Path, cluster) -> str:
    lost = cluster.hosts[1]
    errors = [json.loads(Path(p).read_text()) for p in sorted(glob.glob(str(out / "error.run-0.rank*.json")))]
    survivors = [e for e in errors if e["missing"] is not None]
    assert len(survivors) == 2, errors  # both processes of host 0 diagnosed the failure
    for error in survivors:
        assert error["type"] == "CollectiveTimeoutError", error
        assert error["missing"] == [2, 3], error
        assert f"Lost: host {lost.address} (node 1" in error["error"] and "ranks [2, 3]" in error["error"], error
    return survivors[0]["error"]


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """The same job, uninterrupted, on the same 2 hosts."""
    out = tmp_path_factory.mktemp("uninterrupted")
    finish([launch(h, out, nnodes="2", port=29400) for h in cluster.hosts], out)
    order, worlds, _ = assert_exactly_once(out)
    assert worlds == {"run-0": 4}
    return torch.load(out / "final.pt")


def test_killed_host_restarts_and_the_job_ends_bit_identical(cluster, reference, tmp_path):
    host0, host1 = cluster.hosts
    survivor = launch(host0, tmp_path, nnodes="2", port=29410)
    doomed = launch(host1, tmp_path, nnodes="2", port=29410, job_args=("--stall-at", str(STALL_AT)))
    wait_for_stall(tmp_path)
    killed = host1.kill()
    assert doomed.poll() is not None and len(killed) >= 3  # its launcher and both workers
    # The machine comes back and its launcher is started again, as a supervisor would.
    back = launch(host1, tmp_path, nnodes="2", port=29410, job_args=("--tag", "back"), log="b")
    finish([survivor, back], tmp_path)

    order, worlds, resumes = assert_exactly_once(tmp_path)
    assert order == ["run-0", "run-1"] and worlds == {"run-0": 4, "run-1": 4}
    assert resumes["run-1"] == 4  # the step-4 checkpoint was committed before host 1 died
    print(assert_lost_host_named(tmp_path, cluster))
    final = torch.load(tmp_path / "final.pt")
    for name, value in reference.items():
        assert torch.equal(final[name], value), name  # bit-identical: fp32, same ranks, same order


def test_cut_host_is_left_behind_and_the_survivor_finishes_alone(cluster, reference, tmp_path):
    host0, host1 = cluster.hosts
    survivor = launch(host0, tmp_path, nnodes="1:2", port=29420)
    launch(host1, tmp_path, nnodes="1:2", port=29420, job_args=("--stall-at", str(STALL_AT)))
    wait_for_stall(tmp_path)
    host1.cut()
    try:
        finish([survivor], tmp_path)
    finally:
        host1.kill()
        host1.restore()

    order, worlds, resumes = assert_exactly_once(tmp_path)
    assert order == ["run-0", "run-1"] and worlds == {"run-0": 4, "run-1": 2}  # host 0 alone
    assert resumes["run-1"] == 4
    print(assert_lost_host_named(tmp_path, cluster))
    final = torch.load(tmp_path / "final.pt")
    for name, value in reference.items():
        # Same global batches on 2 processes instead of 4: equal up to float summation order.
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-5)
