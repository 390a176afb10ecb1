"""The ``trainmesh`` command line, end to end: real ``python -m trainmesh`` processes.

``run`` tests start real torchrun jobs of 2 workers; ``env`` tests only read variables.
Bad-usage cases call :func:`trainmesh.launcher.cli.main` in-process because they fail
before anything is launched, and one subprocess case checks the exit status end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import trainmesh
from trainmesh.launcher import cli
from trainmesh.launcher.run import torchrun_argv

# Variables any launcher or scheduler might have left in the test's environment; each would
# change what `trainmesh env` detects or what `trainmesh run` hands its workers.
_JOB_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
    "OMP_NUM_THREADS",
)
_JOB_PREFIXES = ("TRAINMESH_", "SLURM_", "TORCHELASTIC_")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARS and not k.startswith(_JOB_PREFIXES)}
    env.update(extra)
    return env


def trainmesh_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainmesh", *args]


# A test's own timeout is above its spawns' (60 s each): a spawned CLI imports torch, 5-7 s alone here and
# past 30 s with other jobs on the machine; a hang is still caught, with the command in the error.
def run_trainmesh(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        trainmesh_cmd(*args), cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout
    )


def write_script(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


# Records what a worker saw, one JSON file per rank (and per restart) next to the script.
_REPORT_SCRIPT = """
    import json, os, sys
    from pathlib import Path
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT")
    seen = {k: os.environ.get(k) for k in keys}
    seen["argv"] = sys.argv[1:]
    out = Path(os.environ.get("REPORT_DIR") or Path(__file__).parent)
    (out / f"rank{seen['RANK']}.json").write_text(json.dumps(seen))
"""


def read_reports(directory: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in directory.glob("rank*.json")}


@pytest.mark.timeout(70)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_env_single_process(tmp_path: Path, as_json: bool) -> None:
    proc = run_trainmesh("env", *(["--json"] if as_json else []), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    if as_json:
        report = json.loads(proc.stdout)
        assert (report["source"], report["rank"], report["world_size"]) == ("single", 0, 1)
        assert report["devices"] == [f"{'gpu' if report['cuda_available'] else 'cpu'}:0"]
        assert report["trainmesh_version"] == trainmesh.__version__
        assert report["backend"] in ("gloo", "nccl")
        assert report["omp_num_threads"] is None
    else:
        assert "cluster source:   single" in proc.stdout
        assert "rank:             0 of 1" in proc.stdout
        assert f"trainmesh:        {trainmesh.__version__}" in proc.stdout


@pytest.mark.timeout(130)
def test_env_reads_torchrun_variables(tmp_path: Path) -> None:
    env = clean_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.0.0.5", MASTER_PORT="1234", OMP_NUM_THREADS="3")
    text = run_trainmesh("env", cwd=tmp_path, env=env)
    assert text.returncode == 0, text.stderr
    assert "rank:             1 of 2" in text.stdout
    assert "master:           10.0.0.5:1234" in text.stdout
    report = json.loads(run_trainmesh("env", "--json", cwd=tmp_path, env=env).stdout)
    assert (report["source"], report["rank"], report["world_size"]) == ("torchrun", 1, 2)
    assert len(report["devices"]) in (0, 2)  # no entries for "gpu" on a CPU-only box
    assert report["omp_num_threads"] == "3"


@pytest.mark.timeout(70)
def test_env_reads_tf_config(tmp_path: Path) -> None:
    tf_config = {"cluster": {"worker": ["hostA:2222", "hostB:2222"]}, "task": {"type": "worker", "index": 1}}
    proc = run_trainmesh("env", "--json", cwd=tmp_path, env=clean_env(TF_CONFIG=json.dumps(tf_config)))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["source"], report["rank"], report["world_size"]) == ("tf_config", 1, 2)
    assert (report["master_addr"], report["master_port"], report["node_rank"]) == ("hostA", 2222, 1)


@pytest.mark.timeout(70)
def test_env_reports_contradictory_environment(tmp_path: Path) -> None:
    proc = run_trainmesh("env", cwd=tmp_path, env=clean_env(RANK="2", WORLD_SIZE="2"))
    assert proc.returncode == 1
    assert "trainmesh env: error:" in proc.stderr and "rank must be in [0, world_size)" in proc.stderr


@pytest.mark.timeout(130)
def test_version_and_help(tmp_path: Path) -> None:
    version = run_trainmesh("--version", cwd=tmp_path)
    assert (version.returncode, version.stdout.strip()) == (0, f"trainmesh {trainmesh.__version__}")
    help_text = run_trainmesh("--help", cwd=tmp_path)
    assert help_text.returncode == 0
    assert "run" in help_text.stdout and "env" in help_text.stdout


@pytest.mark.timeout(60)
def test_run_two_workers_pass_args_through(tmp_path: Path) -> None:
    script = write_script(tmp_path / "report.py", _REPORT_SCRIPT)
    proc = run_trainmesh("run", "-n", "2", script.name, "--flag", "x", "-n", "5", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    reports = read_reports(tmp_path)
    assert sorted(reports) == [0, 1]
    expected_threads = str(max(1, (os.cpu_count() or 1) // 2))
    for rank, seen in reports.items():
        assert (seen["WORLD_SIZE"], seen["LOCAL_RANK"]) == ("2", str(rank))
        assert seen["OMP_NUM_THREADS"] == expected_threads
        assert seen["argv"] == ["--flag", "x", "-n", "5"]
    assert "OMP_NUM_THREADS" not in proc.stderr  # torchrun's oversubscription warning stays quiet


@pytest.mark.timeout(60)
def test_run_module_keeps_user_omp_setting(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    write_script(tmp_path / "pkg" / "report.py", _REPORT_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(PYTHONPATH=str(tmp_path), REPORT_DIR=str(out), OMP_NUM_THREADS="7")
    proc = run_trainmesh("run", "-n", "2", "-m", "pkg.report", "--x", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    reports = read_reports(out)
    assert sorted(reports) == [0, 1]
    assert all(seen["OMP_NUM_THREADS"] == "7" and seen["argv"] == ["--x"] for seen in reports.values())


@pytest.mark.timeout(60)
def test_run_returns_failed_worker_status(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "fail.py",
        """
        import os, sys
        sys.exit(3 if os.environ["RANK"] == "1" else 0)
    """,
    )
    proc = run_trainmesh("run", "-n", "2", script.name, cwd=tmp_path)
    assert proc.returncode == 3
    assert "FAILED" in proc.stderr


@pytest.mark.timeout(60)
def test_run_restarts_after_failure(tmp_path: Path) -> None:
    crash_first_attempt = textwrap.dedent("""
        import os, sys
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            sys.exit(1)
    """)
    script = write_script(tmp_path / "flaky.py", crash_first_attempt + textwrap.dedent(_REPORT_SCRIPT))
    proc = run_trainmesh(
        "run", "-n", "2", "--max-restarts", "1", "--monitor-interval", "0.1", script.name, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    reports = read_reports(tmp_path)
    assert sorted(reports) == [0, 1]
    # Both files were last written by the restarted group (rank 0 may also have written on attempt 0).
    assert all(seen["TORCHELASTIC_RESTART_COUNT"] == "1" for seen in reports.values())


@pytest.mark.timeout(90)
def test_run_initialize_all_reduce_two_jobs_at_once(tmp_path: Path) -> None:
    """Two standalone jobs on one machine pick their own ports and both get the right sum."""
    body = """
        import json
        from pathlib import Path
        import torch
        import torch.distributed as dist
        import trainmesh
        cluster = trainmesh.initialize()
        value = torch.tensor([float(cluster.rank + 1)])
        dist.all_reduce(value)
        Path(__file__).with_name(f"sum{cluster.rank}.json").write_text(
            json.dumps({"sum": value.item(), "world": trainmesh.world_size(), "source": cluster.source}))
        trainmesh.shutdown()
    """
    jobs = []
    for name in ("job_a", "job_b"):
        (tmp_path / name).mkdir()
        script = write_script(tmp_path / name / "allreduce.py", body)
        jobs.append(
            subprocess.Popen(
                trainmesh_cmd("run", "-n", "2", str(script)),
                cwd=tmp_path,
                env=clean_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for job in jobs:
        _, stderr = job.communicate(timeout=80)
        assert job.returncode == 0, stderr
    for name in ("job_a", "job_b"):
        for rank in (0, 1):
            result = json.loads((tmp_path / name / f"sum{rank}.json").read_text())
            assert result == {"sum": 3.0, "world": 2, "source": "torchrun"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "0", "SCRIPT"], "must be >= 1"),
        (["-n", "2"], "the following arguments are required: SCRIPT"),
        (["-n", "2", "missing.py"], "script not found: 'missing.py'"),
        (
            ["-n", "2", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "SCRIPT"],
            "--node-rank must be < --nnodes",
        ),
        (["-n", "2", "--nnodes", "2", "SCRIPT"], "--rdzv-endpoint HOST:PORT is required"),
    ],
    ids=["zero-procs", "no-script", "script-not-found", "node-rank-too-big", "no-endpoint"],
)
def test_run_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    script = write_script(tmp_path / "ok.py", "")
    argv = [str(script) if a == "SCRIPT" else a for a in argv]
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: trainmesh run") and message in err


@pytest.mark.timeout(70)
def test_run_bad_input_exit_status_from_shell(tmp_path: Path) -> None:
    proc = run_trainmesh("run", "-n", "2", "missing.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert "script not found" in proc.stderr


@pytest.mark.timeout(10)
def test_torchrun_argv_rendezvous() -> None:
    parser = cli.build_parser()
    single = torchrun_argv(parser.parse_args(["run", "-n", "2", "s.py", "-a"]))
    assert "--standalone" in single and single[-2:] == ["s.py", "-a"]
    multi = torchrun_argv(
        parser.parse_args(
            [
                "run",
                "-n",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--rdzv-endpoint",
                "h:29400",
                "--rdzv-id",
                "j",
                "s.py",
            ]
        )
    )
    assert "--standalone" not in multi
    assert multi[multi.index("--rdzv-backend") + 1] == "c10d"
    assert multi[multi.index("--rdzv-endpoint") + 1] == "h:29400"
    assert multi[multi.index("--rdzv-id") + 1] == "j"
    assert multi[multi.index("--rdzv-conf") + 1] == "is_host=0"
