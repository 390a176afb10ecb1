"""tm.initialize() joining real 2-process jobs from each cluster description it reads.

Processes are started here as plain subprocesses so that trainmesh itself has to find
its peers (no harness, no torchrun doing it for it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120), pytest.mark.xdist_group("serial")]

WORKER = os.path.join(os.path.dirname(__file__), "runtime_worker.py")
CLUSTER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
    "GROUP_RANK",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in CLUSTER_VARS and not k.startswith(("SLURM_", "TRAINMESH_", "TORCHELASTIC_"))
    }
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run_workers(envs: list[dict], args_per_rank: list[list[str]], timeout: float = 90) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for env, args in zip(envs, args_per_rank)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("RESULT=")]
            assert proc.returncode == 0 and lines, f"worker failed (rc={proc.returncode}):\n{out}\n{err}"
            results.append(json.loads(lines[-1][len("RESULT=") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return sorted(results, key=lambda r: r["rank"])


def check_two_process_job(results: list[dict], source: str) -> None:
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["world_size"] == 2
        assert r["source"] == source
        assert r["devices"] == ["cpu:0", "cpu:1"]
        assert r["backend"] == "gloo"
        assert r["sum"] == 3.0  # 1 + 2: a real all-reduce crossed both processes
        assert r["idempotent"] is True
        assert r["after_shutdown"] is False
    assert [r["main"] for r in results] == [True, False]


def test_single_process_needs_no_network():
    # No cluster variables at all, and an address that cannot be reached: must not matter.
    (result,) = run_workers([clean_env(MASTER_ADDR="192.0.2.1")], [["plain"]])
    assert result["world_size"] == 1 and result["source"] == "single"
    assert result["devices"] == ["cpu:0"] and result["sum"] == 1.0


def test_torchrun_variables():
    port = str(free_port())
    envs = [
        clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for r in range(2)
    ]
    check_two_process_job(run_workers(envs, [["plain"]] * 2), "torchrun")


def test_tf_config_cluster_spec():
    port = free_port()
    workers = [f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"]
    envs = [
        clean_env(TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}))
        for i in range(2)
    ]
    results = run_workers(envs, [["plain"]] * 2)
    check_two_process_job(results, "tf_config")
    assert [r["local_rank"] for r in results] == [0, 1]


def test_slurm_variables():
    port = str(free_port())
    envs = [
        clean_env(
            SLURM_PROCID=str(r),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(r),
            SLURM_NODEID="0",
            SLURM_JOB_NODELIST="127.0.0.1",
            SLURM_JOB_ID="4242",
            MASTER_PORT=port,
        )
        for r in range(2)
    ]
    check_two_process_job(run_workers(envs, [["plain"]] * 2), "slurm")


def test_explicit_keras_arguments_win_over_environment():
    address = f"127.0.0.1:{free_port()}"
    # Misleading torchrun variables are present; the explicit arguments must win.
    envs = [clean_env(RANK="5", WORLD_SIZE="9") for _ in range(2)]
    results = run_workers(envs, [["explicit", f"{address},{address}", str(r)] for r in range(2)])
    check_two_process_job(results, "arguments")


STALL_S = 90  # how long rank 1 sleeps before its collective


@pytest.mark.parametrize("op", ["barrier", "all_reduce"])
def test_a_stalled_rank_times_out_instead_of_hanging(op):
    port = str(free_port())
    envs = [
        clean_env(
            RANK=str(r),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            TRAINMESH_TIMEOUT_S="3",
            STALL_S=str(STALL_S),
            STALL_OP=op,
        )
        for r in range(2)
    ]
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "stall"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]
    try:
        out, err = procs[0].communicate(timeout=STALL_S + 30)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    line = [x for x in out.splitlines() if x.startswith("RESULT=")]
    assert line, f"rank 0 printed no result:\n{out}\n{err}"
    result = json.loads(line[-1][len("RESULT=") :])
    assert result["barrier"] != "returned"
    if op == "barrier":
        assert "Ranks 1 failed" in result["barrier"]  # monitored_barrier names the rank that did not arrive
    else:
        assert "timed out" in result["barrier"].lower() or "timeout" in result["barrier"].lower(), result
    assert result["waited_s"] < 15, result
    # Rank 0 left while the sleeper still slept (it did not wait for it in teardown); the margin
    # absorbs two interpreters starting on a loaded machine (over 10 s seen).
    assert time.monotonic() - started < STALL_S - 30
