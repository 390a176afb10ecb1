"""The chaos run's quick mode (benchmarks/chaos.py --quick --nproc 2): every fault kind once on a 2-process
ZeRO-2 job with async sharded checkpoints, restarted by `trainmesh run`. Each run must end with
exactly the parameters of the uninterrupted run, resume from the newest valid checkpoint, and never
start from step 0 silently while checkpoints exist. 2 processes, not the benchmark's 4: each fault needs one
peer to strike beside (a killed, stopped or crashing rank and a survivor), and every attempt of every run
starts each process afresh (a torch import apiece), so 4 cost about twice as much for the same checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("serial")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAOS = os.path.join(ROOT, "benchmarks", "chaos.py")
INTERVAL = 2  # chaos.py's checkpoint interval


def test_quick_chaos_run_loses_nothing(tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, CHAOS, "--quick", "--nproc", "2", "--seed", "0", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=560,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    runs, figures = report["runs"], report["figures"]
    kinds = {run["kind"] for run in runs if "skipped" not in run}
    expected = {"sigkill", "sigstop", "corrupt", "kill_during_save"} | (
        {"disk_full"} if os.geteuid() == 0 else set()
    )  # a tmpfs needs root; else skipped, with the reason
    assert kinds >= expected, proc.stdout
    assert report["settings"]["nproc"] == 2, report["settings"]
    for run in runs:
        if "skipped" in run:
            continue
        assert run["exit_code"] == 0 and not run["timed_out"], run
        if run["kind"] == "disk_full":  # issue 47: the failed save is reported, training goes on, no restart
            assert run["attempts"] == 1 and run["not_saved"] >= 1, run
        else:
            assert run["attempts"] >= 2, run  # the fault really struck and the job really restarted
        assert run["resumed_newest_valid"], run  # no more progress lost than the checkpoints allow
        assert run["identical"], run
        if run["kind"] == "sigstop":
            assert run["hang_named"], run  # the survivors' error names the stopped rank
        if run["kind"] == "corrupt":
            assert run["skipped_warnings"] >= 1, run  # the damaged checkpoint was named, not skipped silently
    assert figures["chaos_identical_fraction"] == 1.0, proc.stdout
    assert figures["chaos_silent_fresh_starts"] == 0, proc.stdout
    # Issue 35's goal: an async save is committed within the step after it at the latest (issue 47),
    # so a fault loses at most one interval.
    assert figures["chaos_max_lost_steps"] <= INTERVAL, proc.stdout
