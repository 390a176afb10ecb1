"""Issue 45, first slice: two replica groups of one process under a real torchft Lighthouse (loopback).

One launch checks: the second group to arrive starts from the first one's state (healed over
trainmesh's pickle-free transport, though each seeds its weights differently); one group is SIGKILLed mid-run and the survivor goes on alone, with every
committed step kept (its step counter runs 0..N-1 with no gap), and exits 0; the killed group is
restarted, heals from the survivor at the live step, and from then on its parameters equal the
survivor's at every step and at the end.
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

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150), pytest.mark.xdist_group("serial")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "ft_replica_groups.py")
STEPS = 100
HEARTBEAT_TIMEOUT_S = 1.5


def test_sigkilled_group_loses_no_committed_step_and_rejoins_equal(tmp_path):
    lighthouse, url = lighthouse_on_loopback(HEARTBEAT_TIMEOUT_S)
    env = group_env()
    procs: list[subprocess.Popen] = []

    def launch(group: int, name: str) -> subprocess.Popen:
        out = open(tmp_path / f"{name}.out", "w")
        proc = subprocess.Popen(
            [
                sys.executable,
                EXAMPLE,
                "--replica-group",
                str(group),
                "--lighthouse",
                url,
                "--steps",
                str(STEPS),
                "--step-sleep",
                "0.08",
                "--log",
                str(tmp_path / f"{name}.jsonl"),
                "--save",
                str(tmp_path / f"{name}.pt"),
                "--slow-file",
                str(slow),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        return proc

    log = {name: str(tmp_path / f"{name}.jsonl") for name in ("g0", "g1", "g1b")}
    slow = tmp_path / "slow"  # while it exists the survivor steps once a second, so it cannot finish
    # before the restarted group (whose start-up takes seconds) has joined
    try:
        survivor, victim = launch(0, "g0"), launch(1, "g1")
        # both in the quorum, a few steps committed together
        wait_for(
            lambda: sum(r["committed"] and r["replicas"] == 2 for r in records(log["g1"])) >= 3,
            60,
            "3 committed steps with both groups",
            procs,
        )
        victim.send_signal(signal.SIGKILL)
        killed_at = time.time()
        victim.wait(timeout=10)
        wait_for(
            lambda: any(r["committed"] and r["replicas"] == 1 and r["time"] > killed_at for r in records(log["g0"])),
            30,
            "the survivor's first commit alone",
            [survivor],
        )
        slow.touch()
        restarted = launch(1, "g1b")
        wait_for(
            lambda: any(r["committed"] for r in records(log["g1b"])),
            90,
            "the restarted group's first commit",
            [survivor, restarted],
        )
        slow.unlink()
        assert restarted.wait(timeout=90) == 0, (tmp_path / "g1b.out").read_text()[-3000:]
        assert survivor.wait(timeout=30) == 0, (tmp_path / "g0.out").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lighthouse.shutdown()

    g0, g1, g1b = records(log["g0"]), records(log["g1"]), records(log["g1b"])
    # The later of the two groups started from the earlier one's state (different seeds, healed on arrival).
    assert g1[0]["healed"] or g0[0]["healed"]
    # No committed step lost: from its first step (0, or the step it healed at if the other group started
    # first) the survivor committed each step to the end exactly once, in order, through the kill; with the
    # victim's, every step of the run was committed.
    committed = [r["step"] for r in g0 if r["committed"]]
    assert g0[0]["step"] == 0 or g0[0]["healed"], g0[0]
    assert committed == list(range(g0[0]["step"], STEPS))
    assert set(committed) | {r["step"] for r in g1 if r["committed"]} == set(range(STEPS))
    assert max(r["step"] for r in g1 if r["committed"]) in committed  # the victim's last commit survived it
    after_kill = [r for r in g0 if r["time"] > killed_at]
    # one step fails with the dead peer (observed: 1); 3 leaves room for a heartbeat missed on a loaded CI box
    assert sum(not r["committed"] for r in g0) <= 3, [r for r in g0 if not r["committed"]]
    first_alone = next(r for r in after_kill if r["committed"] and r["replicas"] == 1)
    recovery_s = first_alone["time"] - killed_at
    print(
        f"survivor's first commit alone {recovery_s:.2f} s after the SIGKILL "
        f"(heartbeat timeout {HEARTBEAT_TIMEOUT_S} s)"
    )
    assert recovery_s < HEARTBEAT_TIMEOUT_S + 6.0  # the goal is + 1.5 s; a shared 2-core CI box needs slack
    # The restarted group healed from the survivor at the live step, not from step 0 ...
    assert g1b[0]["healed"] and g1b[0]["step"] > 0, g1b[0]
    # ... and its parameters equal the survivor's at every step from then on, and at the end.
    survivor_sums = {r["step"]: r["param_sum"] for r in g0 if r["committed"]}
    rejoined = [r for r in g1b if r["committed"]]
    assert rejoined and all(r["param_sum"] == survivor_sums[r["step"]] for r in rejoined)
    assert [r["step"] for r in rejoined] == list(range(rejoined[0]["step"], STEPS))
    final0 = torch.load(tmp_path / "g0.pt", weights_only=True)
    final1 = torch.load(tmp_path / "g1b.pt", weights_only=True)
    assert final0.keys() == final1.keys() and all(torch.equal(final0[k], final1[k]) for k in final0)
