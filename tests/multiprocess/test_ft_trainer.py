"""Issue 45: ``tm.Trainer(..., fault_tolerance=tm.ReplicaGroups())`` survives a SIGKILLed replica group.

Two replica groups of one process each (examples/ft_trainer.py: a small MLP on a 800-sample
TensorDataset, global batch 8, 100 steps) under a real torchft Lighthouse on loopback. One launch
checks: a group SIGKILLed mid-run costs the survivor no committed step (its step counter runs to
the end with no gap or repeat) and at most one uncommitted step, and it exits 0; the killed group,
restarted through `trainmesh run --replica-group 1 --lighthouse URL`, heals from the survivor at the live step (the whole Trainer state: model, optimizer,
schedule, step counter, data position, RNG) and from then on its parameters equal the survivor's
at every step and at the end; both end with the same committed-batch count; and every sample of
the epoch is in exactly one committed step (the batch of the step that failed with the kill is
trained again, not skipped).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'trainmesh[ft]')")
from torchft.coordination import LighthouseServer  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "ft_trainer.py")
SAMPLES, BATCH = 800, 8
STEPS = SAMPLES // BATCH
HEARTBEAT_TIMEOUT_S = 1.5


def _records(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.endswith("\n")]


def _wait(predicate, timeout_s: float, what: str, procs) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        for proc in procs:
            if proc.poll() not in (None, 0):
                raise AssertionError(f"a group exited {proc.returncode} while waiting for {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_trainer_survives_a_sigkilled_group_and_the_restarted_group_heals(tmp_path):
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT_S * 1000)
    )
    url = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.path.join(ROOT, "src"),
        "RUST_LOG": "warn",
    }
    slow = tmp_path / "slow"  # while it exists the survivor steps once a second: the restart joins before the end
    procs: list[subprocess.Popen] = []

    def launch(group: int, name: str, launcher: bool = False) -> subprocess.Popen:
        # the restarted group goes through `trainmesh run --replica-group 1 --lighthouse URL` (its workers read
        # the group and the URL from the environment the launcher sets); the first two start as plain processes
        command = ["-m", "trainmesh", "run", "-n", "1", "--replica-group", str(group), "--lighthouse", url]
        argv = [
            *(command if launcher else []),
            EXAMPLE,
            "--samples",
            str(SAMPLES),
            "--step-sleep",
            "0.1",
            "--slow-file",
            str(slow),
        ]
        argv += ["--step-log", str(tmp_path / f"{name}.jsonl"), "--save", str(tmp_path / f"{name}.pt")]
        proc = subprocess.Popen(
            [sys.executable, *argv],
            env=env if launcher else {**env, "TRAINMESH_REPLICA_GROUP": str(group), "TORCHFT_LIGHTHOUSE": url},
            stdout=open(tmp_path / f"{name}.out", "w"),
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        return proc

    log = {name: tmp_path / f"{name}.jsonl" for name in ("g0", "g1", "g1b")}
    started = time.monotonic()
    try:
        survivor, victim = launch(0, "g0"), launch(1, "g1")
        _wait(lambda: sum(r["replicas"] == 2 for r in _records(log["g1"])) >= 3, 90, "3 steps of both", procs)
        victim.send_signal(signal.SIGKILL)
        killed_at = time.time()
        victim.wait(timeout=10)
        _wait(
            lambda: any(r["replicas"] == 1 and r["time"] > killed_at for r in _records(log["g0"])),
            30,
            "the survivor's first commit alone",
            [survivor],
        )
        slow.touch()
        restarted = launch(1, "g1b", launcher=True)
        _wait(lambda: _records(log["g1b"]), 90, "the restarted group's first commit", [survivor, restarted])
        slow.unlink()
        assert restarted.wait(timeout=60) == 0, (tmp_path / "g1b.out").read_text()[-3000:]
        assert survivor.wait(timeout=30) == 0, (tmp_path / "g0.out").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lighthouse.shutdown()
    wall_s = time.monotonic() - started

    g0, g1, g1b = _records(log["g0"]), _records(log["g1"]), _records(log["g1b"])
    # No committed step lost: the survivor's step counter runs to the end, each step once, through the kill
    # (from 1, or from where it healed if the other group started first).
    steps = [r["step"] for r in g0]
    assert steps == list(range(steps[0], STEPS + 1)) and (steps[0] == 1 or g0[0]["healed"]), steps
    assert {r["step"] for r in g1} <= set(steps) | set(range(1, steps[0]))
    # At most one step did not commit: the one whose all-reduce met the dead peer.
    uncommitted = g0[-1]["uncommitted_steps"]
    assert uncommitted <= 1, uncommitted
    first_alone = next(r for r in g0 if r["replicas"] == 1 and r["time"] > killed_at)
    # The restarted group healed at the live step, not from step 0, with the survivor's parameters ...
    assert g1b[0]["healed"] and g1b[0]["step"] > 1, g1b[0]
    survivor_sums = {r["step"]: r["param_sum"] for r in g0}
    assert [r["step"] for r in g1b] == list(range(g1b[0]["step"], STEPS + 1))
    assert all(r["param_sum"] == survivor_sums[r["step"]] for r in g1b)
    final0 = torch.load(tmp_path / "g0.pt", weights_only=True)
    final1 = torch.load(tmp_path / "g1b.pt", weights_only=True)
    assert final0["model"].keys() == final1["model"].keys()
    assert all(torch.equal(final0["model"][k], final1["model"][k]) for k in final0["model"])
    # ... and both end at the same committed step with the same committed-batch count.
    assert final0["step"] == final1["step"] == STEPS and final0["batches_committed"] == final1["batches_committed"]
    # Each sample of the epoch in exactly one committed step, on both sides of the heal.
    by_step = {r["step"]: r["samples"] for r in g1 if r["step"] < steps[0]}  # steps before the survivor joined
    by_step.update({r["step"]: r["samples"] for r in g0})
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert sorted(i for batch in by_step.values() for i in batch) == list(range(SAMPLES)), "a sample skipped or twice"
    assert all(r["samples"] == by_step[r["step"]] for r in g1b)
    print(
        f"wall {wall_s:.1f} s; uncommitted {uncommitted}; survivor alone "
        f"{first_alone['time'] - killed_at:.2f} s after the SIGKILL; rejoined at step {g1b[0]['step']}"
    )


def test_fault_tolerance_is_checked_before_any_quorum(monkeypatch):
    import trainmesh as tm

    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="fault_tolerance must be a trainmesh.ReplicaGroups"):
        tm.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(), fault_tolerance=True)
    groups = tm.ReplicaGroups(replica_group=0, lighthouse="http://127.0.0.1:1")  # never contacted here
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one process per replica group. .*WORLD_SIZE=2"):
        tm.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(), fault_tolerance=groups)
    monkeypatch.delenv("WORLD_SIZE")
    trainer = tm.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(), fault_tolerance=groups, progress=False
    )
    batches = [(torch.ones(4, 2), torch.ones(4, 1))]  # an iterable of batches: no sampler position to resume at
    with pytest.raises(ValueError, match="needs a map-style dataset"):
        trainer.fit(batches)
