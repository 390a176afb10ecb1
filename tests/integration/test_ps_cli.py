"""``trainmesh run --servers K`` and ``trainmesh ps-server`` end to end: real torchrun workers,
real server processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from trainmesh.launcher import cli

pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("serial")]

_JOB_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
)
_JOB_PREFIXES = ("TRAINMESH_", "SLURM_", "TORCHELASTIC_")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARS and not k.startswith(_JOB_PREFIXES)}
    src = str(Path(__import__("trainmesh").__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


_SCRIPT = """
    import json, os, sys
    import torch
    from torch import nn
    import trainmesh as tm

    torch.manual_seed(int(os.environ["RANK"]))  # different on purpose: worker 0's values win
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    y = x @ torch.randn(4, 1, generator=gen)
    strategy = tm.ParameterServerStrategy(mode="sync")
    trainer = tm.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                         distribution=strategy, progress=False)
    history = trainer.fit(torch.utils.data.TensorDataset(x, y), epochs=3, batch_size=16)
    report = {"servers": os.environ.get("TRAINMESH_PS_SERVERS"), "loss": history.history["loss"],
              "params": [p.detach().flatten().tolist() for p in model.parameters()]}
    strategy.close()
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as fh:
        json.dump(report, fh)
"""


def _port_is_free(address: str) -> bool:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as probe:
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
    return True


def test_run_with_servers_trains_two_workers_and_stops_the_servers(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    done = subprocess.run(
        [sys.executable, "-m", "trainmesh", "run", "--servers", "2", "-n", "2", str(script), str(tmp_path)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    addresses = reports[0]["servers"].split(",")
    assert len(addresses) == 2 and reports[1]["servers"] == reports[0]["servers"]
    assert reports[0]["params"] == reports[1]["params"]  # both read the same server values
    assert reports[0]["loss"][-1] < 0.5 * reports[0]["loss"][0]
    assert "2 parameter server(s)" in done.stderr
    assert all(_port_is_free(address) for address in addresses), "servers still running after the job"


def test_recommender_example_learns_on_two_workers(tmp_path: Path):
    example = Path(__file__).resolve().parents[2] / "examples" / "ps_recommender.py"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmesh",
            "run",
            "--servers",
            "2",
            "-n",
            "2",
            str(example),
            "--users",
            "1000",
            "--items",
            "50000",
            "--active-items",
            "1000",
            "--clicks",
            "100000",
            "--batch",
            "256",
            "--lr",
            "0.1",
        ],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if "held-out AUC" in line)
    learned, ceiling = (
        float(part.split()[-1].rstrip(")").rstrip(";"))
        for part in (line.split(" (")[0], line.split("probabilities: ")[1].split(")")[0])
    )
    assert 0.62 < learned < ceiling, line  # well above chance (0.5), below the generator's own AUC


def test_ps_server_command_serves_a_client_until_sigterm(tmp_path: Path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    secret = "documented-manual-path-secret"
    server = subprocess.Popen(
        [sys.executable, "-m", "trainmesh", "ps-server", "--bind", f"127.0.0.1:{port}", "--num-workers", "1"],
        env=clean_env(TRAINMESH_PS_SECRET=secret),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready = server.stdout.readline().strip()
        assert ready == f"READY tcp://127.0.0.1:{port}"
        from trainmesh.ps.client import PSClient

        with PSClient(servers=[f"tcp://127.0.0.1:{port}"], worker_id=0, num_workers=1, secret=secret) as client:
            client.init(
                [{"name": "w", "kind": "dense", "value": torch.ones(3), "optimizer": {"name": "sgd", "lr": 0.5}}]
            )
            client.push({"w": torch.tensor([1.0, 2.0, 3.0])}).result()
            torch.testing.assert_close(client.pull(["w"]).result()["w"], torch.tensor([0.5, 0.0, -0.5]))
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)


def test_a_default_loopback_server_makes_a_private_secret_and_refuses_a_strangers_shutdown(tmp_path, monkeypatch):
    """``python -m trainmesh.ps`` with no secret: it makes one, in a 0600 file it names; a stranger's
    SHUTDOWN is refused at once, naming authentication; the job's processes read the file."""
    from trainmesh.ps.cluster import AdminConnection
    from trainmesh.ps.errors import PSAuthError
    from trainmesh.ps.protocol import MessageType

    monkeypatch.delenv("TRAINMESH_PS_SECRET", raising=False)
    monkeypatch.delenv("TRAINMESH_PS_SECRET_FILE", raising=False)
    log = tmp_path / "server.log"
    with open(log, "w") as err:
        server = subprocess.Popen(
            [sys.executable, "-m", "trainmesh.ps", "--bind", "127.0.0.1:0"],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        address = server.stdout.readline().strip().removeprefix("READY ")
        path = log.read_text().split("give it to the job's processes as TRAINMESH_PS_SECRET_FILE=")[1].split()[0]
        assert os.stat(path).st_mode & 0o777 == 0o600
        for secret in (None, "a-guess"):
            started = time.monotonic()
            with AdminConnection([address], secret, timeout_s=60) as stranger:
                with pytest.raises(PSAuthError, match="authentication failed"):
                    stranger.ask(0, MessageType.SHUTDOWN)
            assert time.monotonic() - started < 5.0
        assert server.poll() is None  # still serving
        monkeypatch.setenv("TRAINMESH_PS_SECRET_FILE", path)
        with AdminConnection([address], timeout_s=30) as owner:
            assert owner.ask(0, MessageType.STATS).meta["unauthenticated"] >= 2
            assert owner.ask(0, MessageType.SHUTDOWN).type is MessageType.OK
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        if "path" in locals():
            os.remove(path)
            os.rmdir(os.path.dirname(path))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--servers", "0", "-n", "2", "x.py"], "must be >= 1"),
        (["run", "--servers", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1", "-n", "2", "x.py"], "--nnodes 2"),
    ],
)
def test_run_servers_bad_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


_LAUNCHER = """
    import sys, time
    from trainmesh.ps.cluster import LocalCluster
    cluster = LocalCluster(2, directory=sys.argv[1])
    print(" ".join(str(p.pid) for p in cluster.processes), flush=True)
    time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_servers_exit_when_the_launcher_is_sigkilled(tmp_path):
    """A LocalCluster's servers watch their parent: SIGKILL the launcher and they stop by themselves."""
    import time

    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_LAUNCHER), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    server_pids = [int(p) for p in launcher.stdout.readline().split()]
    try:
        assert len(server_pids) == 2 and not any(_gone(pid) for pid in server_pids)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_gone(pid) for pid in server_pids):
            time.sleep(0.2)
        assert all(_gone(pid) for pid in server_pids), f"orphaned servers still running: {server_pids}"
        logs = "".join((tmp_path / f"server{i}.log").read_text() for i in range(2))
        assert "parent process" in logs and "is gone" in logs
    finally:
        for pid in server_pids:  # only if the assertion failed: never leave them behind
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
