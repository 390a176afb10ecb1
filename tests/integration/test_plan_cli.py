"""``trainmesh plan`` end to end: real ``python -m trainmesh plan`` processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainmesh", "plan", *args], capture_output=True, text=True, timeout=100
    )


def test_json_from_a_module_factory_parses():
    proc = run_plan(
        "trainmesh.launcher.plan:_example_factory",
        "--world-size",
        "4",
        "--micro-batch",
        "2",
        "--seq-len",
        "128",
        "--precision",
        "bf16-mixed",
        "--checkpointing",
        "every:2",
        "--budget",
        "1GiB",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["world_size"] == 4 and report["budget"] == 2**30
    assert [(r["zero_stage"], r["activation_checkpointing"]) for r in report["rows"]] == [
        (s, c) for s in range(4) for c in (None, "every:2")
    ]
    assert all(r["fits"] is True for r in report["rows"])
    totals = [r["total"] for r in report["rows"] if r["activation_checkpointing"] is None]
    assert totals[3] < totals[0]


def test_table_for_the_example_and_one_stage():
    proc = run_plan("--example", "--world-size", "2", "--micro-batch", "4", "--zero-stage", "3", "--budget", "1MiB")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "per-rank memory" in lines[0] and "fits" in lines[1]
    assert [line.split()[0] for line in lines[2:4]] == ["3", "3"] and lines[2].rstrip().endswith("no")


def test_usage_errors():
    assert run_plan("--world-size", "2", "--micro-batch", "4").returncode == 2  # no model
    proc = run_plan("nomodule_xyz:build", "--world-size", "2", "--micro-batch", "4")
    assert proc.returncode == 2 and "nomodule_xyz" in proc.stderr
    proc = run_plan("--example", "--world-size", "2", "--micro-batch", "4", "--budget", "lots")
    assert proc.returncode == 2 and "Received" in proc.stderr


def test_mesh_plan_writes_json_and_exits_3_when_it_does_not_fit(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_plan(
        "--world-size",
        "8",
        "--mesh",
        "data=4,model=2",
        "--model",
        "tiny-llama",
        "--zero",
        "3",
        "--seq",
        "64",
        "--precision",
        "fp32",
        "--device-memory",
        "4MiB",
        "--json",
        str(out),
    )
    assert proc.returncode == 3, proc.stderr
    assert "PLAN" in proc.stdout and "does NOT fit (over by" in proc.stdout and "knob that helps most" in proc.stdout
    plan = json.loads(out.read_text())
    assert plan["mesh"] == "data=4,model=2" and plan["fits"] is False
    rows = {(r["axis"], r["kind"]) for r in plan["ranks"][0]["collectives"]}
    assert {("data", "all_gather"), ("data", "reduce_scatter"), ("model", "all_reduce")} <= rows
    assert plan["step"]["seconds"] > 0 and plan["hardware"]["name"] == "h100"
    bad = run_plan("--world-size", "8", "--mesh", "data=3,model=2", "--model", "tiny-llama", "--seq", "64")
    assert bad.returncode == 2 and "multiplies to 6 ranks" in bad.stderr
