"""Issue 45: replica groups of two processes each, ZeRO-2 inside a group, gradients averaged across groups.

Each group is its own ``trainmesh run -n 2 --replica-group R --lighthouse URL examples/ft_trainer.py
--zero-stage 2`` (its own torchrun job and rendezvous) under a real torchft Lighthouse on loopback.
Rank r of each group holds the same ZeRO shard, and torchft pairs rank r of every group: the
cross-group average and the recovery go shard by shard (the replicate dimension of HSDP).

* Parity: 2 groups x 2 processes, no fault, equal one process (no replica groups, no ZeRO) on the
  same global batches, within 1e-6 in fp32 after 3 steps, for SGD and AdamW.
* A whole group SIGKILLed (its launcher and both workers) mid-run:
  the survivors exit 0 with every committed step kept; the group restarted heals both its ranks
  from the survivors' same ranks, and from then on its parameters equal theirs at every step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'trainmesh[ft]')")
from ft_processes import group_env, lighthouse_on_loopback, records, wait_for  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("serial")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "ft_trainer.py")
HEARTBEAT_TIMEOUT_S = 1.5
SAMPLES = 960


def _launch(tmp_path, name: str, argv: list[str], group: int | None, url: str | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "trainmesh", "run", "-n", "2" if group is not None else "1"]
    if group is not None:
        command += ["--replica-group", str(group), "--lighthouse", url]
    return subprocess.Popen(
        [
            *command,
            EXAMPLE,
            *argv,
            "--step-log",
            str(tmp_path / f"{name}.jsonl"),
            "--save",
            str(tmp_path / f"{name}.pt"),
        ],
        env=group_env(),
        stdout=open(tmp_path / f"{name}.out", "w"),
        stderr=subprocess.STDOUT,
    )


def _kill_group(proc: subprocess.Popen) -> int:
    """SIGKILL a group's launcher and every process under it (torchrun starts each worker in its own
    session, so one killpg would not reach them): how many processes were killed."""
    import psutil

    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for member in family:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    return len(family)


def _end(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            _kill_group(proc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_two_groups_of_two_with_zero2_equal_one_process(tmp_path, optimizer):
    # min_replicas=2 at the Lighthouse: the first quorum waits for both groups, so every step has both
    lighthouse, url = lighthouse_on_loopback(HEARTBEAT_TIMEOUT_S, min_replicas=2)
    common = ["--samples", "24", "--seed", "0", "--optimizer", optimizer]  # 3 steps of a global batch of 8
    procs = [_launch(tmp_path, f"g{g}", [*common, "--zero-stage", "2"], g, url) for g in (0, 1)]
    procs.append(_launch(tmp_path, "ref", [*common, "--no-ft"], None, None))
    try:
        for proc, name in zip(procs, ("g0", "g1", "ref")):
            assert proc.wait(timeout=100) == 0, (tmp_path / f"{name}.out").read_text()[-3000:]
    finally:
        _end(procs)
        lighthouse.shutdown()
    for name in ("g0", "g1"):
        steps = records(tmp_path / f"{name}.jsonl")
        assert [(r["step"], r["replicas"]) for r in steps] == [(1, 2), (2, 2), (3, 2)], steps
    ref_steps = records(tmp_path / "ref.jsonl")
    # the same global batches: a group's rank 0 logs its half of each (the groups split that half again)
    assert [r["samples"][:4] for r in ref_steps] == [r["samples"] for r in records(tmp_path / "g0.jsonl")]
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)["model"]
    for name in ("g0", "g1"):
        got = torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"]
        assert got.keys() == ref.keys()
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], rtol=0, atol=1e-6, msg=f"{name} {key}")


@pytest.mark.timeout(300)
def test_a_sigkilled_group_of_two_loses_no_committed_step_and_rejoins_equal(tmp_path):
    lighthouse, url = lighthouse_on_loopback(HEARTBEAT_TIMEOUT_S)
    slow = tmp_path / "slow"  # while it exists the survivors step once a second: the restart joins before the end
    # 120 steps: paced at 1 s a step while the restarted group starts (tens of seconds on a loaded box)
    argv = ["--samples", str(SAMPLES), "--zero-stage", "2", "--step-sleep", "0.1", "--slow-file", str(slow)]
    log = {name: tmp_path / f"{name}.jsonl" for name in ("g0", "g1", "g1b")}
    procs: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        survivor, victim = _launch(tmp_path, "g0", argv, 0, url), _launch(tmp_path, "g1", argv, 1, url)
        procs += [survivor, victim]
        # Start-up only (4 processes importing torch, two quorums): not a property under test, and above
        # load ~25 on 2 cores it took over 60 s, on the unchanged code too.
        wait_for(lambda: sum(r["replicas"] == 2 for r in records(log["g1"])) >= 3, 120, "3 steps of both", procs)
        assert _kill_group(victim) >= 3  # the launcher and both its workers
        killed_at = time.time()
        wait_for(
            lambda: any(r["replicas"] == 1 and r["time"] > killed_at for r in records(log["g0"])),
            30,
            "the survivors' first commit alone",
            [survivor],
        )
        slow.touch()
        restarted = _launch(tmp_path, "g1b", argv, 1, url)
        procs.append(restarted)
        wait_for(lambda: records(log["g1b"]), 60, "the restarted group's first commit", [survivor, restarted])
        slow.unlink()
        assert restarted.wait(timeout=60) == 0, (tmp_path / "g1b.out").read_text()[-3000:]
        assert survivor.wait(timeout=30) == 0, (tmp_path / "g0.out").read_text()[-3000:]
    finally:
        _end(procs)
        lighthouse.shutdown()
    g0, g1, g1b = records(log["g0"]), records(log["g1"]), records(log["g1b"])
    steps = SAMPLES // 8
    # no committed step lost: the survivors' step counter runs to the end with no gap or repeat
    assert [r["step"] for r in g0] == list(range(g0[0]["step"], steps + 1))
    assert g0[0]["step"] == 1 or g0[0]["healed"]
    assert max(r["step"] for r in g1) in {r["step"] for r in g0}  # the victim's last commit survived it
    assert g0[-1]["uncommitted_steps"] <= 3  # observed 1 (the step in flight at the kill)
    # the restarted group healed at the live step (both ranks: its param_sum gathers both shards) ...
    assert g1b[0]["healed"] and g1b[0]["step"] > max(r["step"] for r in g1), g1b[0]
    # ... and equals the survivors at every later step, and at the end
    survivor_sums = {r["step"]: r["param_sum"] for r in g0}
    assert all(r["param_sum"] == survivor_sums[r["step"]] for r in g1b)
    assert [r["step"] for r in g1b] == list(range(g1b[0]["step"], steps + 1))
    final0 = torch.load(tmp_path / "g0.pt", weights_only=True)
    final1 = torch.load(tmp_path / "g1b.pt", weights_only=True)
    assert all(torch.equal(final0["model"][k], final1["model"][k]) for k in final0["model"])
    assert final0["batches_committed"] == final1["batches_committed"] and final0["step"] == final1["step"] == steps
    print(f"wall {time.monotonic() - started:.1f} s; rejoined at step {g1b[0]['step']}")
