"""Configuration checked at the door (issue 35, item 5): a port outside 1..65535, an empty host or
an address used twice is a ValueError naming the variable and the value, raised before any
connection is tried, wherever the address comes from (TF_CONFIG, Slurm, MASTER_ADDR/MASTER_PORT,
``initialize(job_addresses=...)``, ``--rdzv-endpoint``, PyTorchJob variables, TRAINMESH_PS_SERVERS)
and whoever reads it (``detect_cluster_env``, ``initialize()``, ``trainmesh env``, ``trainmesh run``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist

import trainmesh as tm
from trainmesh.launcher import cli, run
from trainmesh.runtime.addresses import expand_slurm_nodelist, parse_server_list
from trainmesh.runtime.cluster_env import detect_cluster_env

pytestmark = pytest.mark.timeout(60)


def _tf(workers, **roles):
    return {"TF_CONFIG": json.dumps({"cluster": {"worker": workers, **roles}, "task": {"type": "worker", "index": 0}})}


SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2"}

# (environment, words the error must contain: the variable, the bad value, the reason)
BAD_ENVIRONMENTS = {
    "tf_config_port_99999": (
        _tf(["a:2222", "b:99999"]),
        ["TF_CONFIG", "cluster.worker[1]='b:99999'", "outside 1..65535"],
    ),
    "tf_config_port_0": (_tf(["a:0"]), ["TF_CONFIG", "cluster.worker[0]='a:0'", "outside 1..65535"]),
    "tf_config_empty_host": (_tf([":2222"]), ["TF_CONFIG", "cluster.worker[0]=':2222'", "host is empty"]),
    "tf_config_duplicate": (
        _tf(["a:1", "b:1", "a:1"]),
        ["TF_CONFIG", "cluster.worker[0] and cluster.worker[2]", "a:1"],
    ),
    "tf_config_duplicate_across_roles": (
        _tf(["a:1"], chief=["a:1"]),
        ["TF_CONFIG", "cluster.worker[0]", "cluster.chief[0]"],
    ),
    "tf_config_bad_ps": (_tf(["a:1"], ps=["p:123456"]), ["TF_CONFIG", "cluster.ps[0]='p:123456'"]),
    "master_port_99999": ({**TORCHRUN, "MASTER_PORT": "99999"}, ["MASTER_PORT", "'99999'", "outside 1..65535"]),
    "master_port_0": ({**TORCHRUN, "MASTER_PORT": "0"}, ["MASTER_PORT", "'0'", "outside 1..65535"]),
    "trainmesh_master_port": (
        {"TRAINMESH_RANK": "0", "TRAINMESH_WORLD_SIZE": "2", "TRAINMESH_MASTER_PORT": "-5"},
        ["TRAINMESH_MASTER_PORT", "'-5'"],
    ),
    "master_addr_blank": ({**TORCHRUN, "MASTER_ADDR": "  "}, ["MASTER_ADDR", "host is empty"]),
    "slurm_master_port": ({**SLURM, "MASTER_PORT": "70000"}, ["MASTER_PORT", "'70000'", "outside 1..65535"]),
    "slurm_empty_host": ({**SLURM, "SLURM_JOB_NODELIST": "n1,,n2"}, ["SLURM_JOB_NODELIST", "'n1,,n2'", "empty host"]),
    "slurm_duplicate": ({**SLURM, "SLURM_STEP_NODELIST": "n[1-2],n2"}, ["SLURM_STEP_NODELIST", "n2 more than once"]),
    "slurm_bad_range": ({**SLURM, "SLURM_NODELIST": "n[5-3]"}, ["SLURM_NODELIST", "bad range '5-3'"]),
}


@pytest.mark.parametrize("env,words", BAD_ENVIRONMENTS.values(), ids=BAD_ENVIRONMENTS.keys())
def test_each_bad_address_is_named_by_detection(env, words):
    with pytest.raises(ValueError) as raised:
        detect_cluster_env(environ=env)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


@pytest.mark.parametrize(
    ("addresses", "words"),
    [
        ("a:1,a:70000", ["job_addresses='a:70000'", "outside 1..65535"]),
        ("a:1,:2", ["job_addresses=':2'", "host is empty"]),
    ],
)
def test_each_bad_job_address_is_named(addresses, words):
    with pytest.raises(ValueError) as raised:
        detect_cluster_env(addresses, num_processes=None if isinstance(addresses, str) else 3, process_id=0, environ={})
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_a_repeated_job_address_is_the_coordinator_named_once_per_process():
    # Keras scripts on one host pass the coordinator for every process; only the first is ever used.
    env = detect_cluster_env(["127.0.0.1:5", "127.0.0.1:5"], num_processes=2, process_id=1, environ={})
    assert (env.world_size, env.rank, env.master_addr, env.master_port) == (2, 1, "127.0.0.1", 5)


def test_good_addresses_still_pass():
    assert detect_cluster_env(environ=_tf(["a:1", "a:2", "b:65535"])).world_size == 3
    assert detect_cluster_env(environ={**TORCHRUN, "MASTER_PORT": "65535"}).master_port == 65535
    assert detect_cluster_env(environ={**SLURM, "SLURM_JOB_NODELIST": "gpu[01-02,7]"}).master_addr == "gpu01"
    assert expand_slurm_nodelist("a[1-2]-b[08-09],c", name="X") == ["a1-b08", "a1-b09", "a2-b08", "a2-b09", "c"]
    assert parse_server_list("tcp://h:1, h:2,ipc:///tmp/s", name="X") == ["tcp://h:1", "h:2", "ipc:///tmp/s"]


@pytest.mark.usefixtures("no_process_group_left_behind")
def test_initialize_names_the_bad_port_before_any_connection(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps({"cluster": {"worker": ["127.0.0.1:99999", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}),
    )
    for name in ("RANK", "WORLD_SIZE", "TRAINMESH_RANK", "TRAINMESH_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)

    def no_connection(*args, **kwargs):
        raise AssertionError("initialize() tried to connect")

    monkeypatch.setattr(dist, "init_process_group", no_connection)
    if dist.is_initialized():
        pytest.skip("a process group is already running in this test process")
    with pytest.raises(ValueError, match=re.escape("cluster.worker[0]='127.0.0.1:99999'")):
        tm.initialize()


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        (
            "TF_CONFIG",
            json.dumps({"cluster": {"worker": ["h:99999"]}, "task": {"type": "worker", "index": 0}}),
            ["TF_CONFIG", "cluster.worker[0]='h:99999'", "outside 1..65535"],
        ),
        ("TRAINMESH_PS_SERVERS", "tcp://a:1,tcp://a:1", ["TRAINMESH_PS_SERVERS", "entry 0", "entry 1", "a:1"]),
        ("TRAINMESH_PS_SERVERS", "tcp://:5555", ["TRAINMESH_PS_SERVERS", "host is empty"]),
        ("TRAINMESH_PS_SERVERS", "tcp://a:99999", ["TRAINMESH_PS_SERVERS", "outside 1..65535"]),
    ],
)
def test_trainmesh_env_names_the_bad_address(monkeypatch, capsys, name, value, words):
    for other in (
        "TF_CONFIG",
        "RANK",
        "WORLD_SIZE",
        "TRAINMESH_RANK",
        "TRAINMESH_WORLD_SIZE",
        "SLURM_PROCID",
        "TRAINMESH_PS_SERVERS",
    ):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    assert cli.main(["env"]) == 1
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


@pytest.mark.parametrize(
    ("argv", "environ", "words"),
    [
        (["--nnodes", "2", "--rdzv-endpoint", "h:99999"], {}, ["--rdzv-endpoint h:99999", "outside 1..65535"]),
        (["--nnodes", "2", "--rdzv-endpoint", "h:0"], {}, ["--rdzv-endpoint h:0", "outside 1..65535"]),
        (["--nnodes", "2", "--rdzv-endpoint", ":29400"], {}, ["--rdzv-endpoint :29400", "host is empty"]),
        (["--nnodes", "2"], {"PET_RDZV_ENDPOINT": "h:99999"}, ["PET_RDZV_ENDPOINT='h:99999'", "outside 1..65535"]),
        (["--nnodes", "2"], {"PET_MASTER_ADDR": "h", "PET_MASTER_PORT": "0"}, ["PET_MASTER_PORT='0'"]),
        ([], {"TRAINMESH_PS_SERVERS": "tcp://a:1,tcp://a:1"}, ["TRAINMESH_PS_SERVERS", "same address a:1"]),
    ],
)
def test_the_launcher_names_the_bad_address_before_starting_anything(script, capsys, monkeypatch, argv, environ, words):
    for name in (
        "PET_NNODES",
        "PET_NODE_RANK",
        "PET_RDZV_ENDPOINT",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
        "TRAINMESH_PS_SERVERS",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(run, "choose_local_addr", lambda endpoint: pytest.fail("the launcher looked for a route"))
    parser = cli.build_parser()
    args = parser.parse_args(["run", "-n", "1", *argv, script])
    with pytest.raises(SystemExit) as exit_info:
        run.handle(args, args.command_parser)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.usefixtures("no_process_group_left_behind")  # the strategy starts a one-process group
@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("tcp://a:1,tcp://a:1", ["TRAINMESH_PS_SERVERS", "a:1"]),
        ("tcp://a:99999", ["TRAINMESH_PS_SERVERS", "outside 1..65535"]),
    ],
)
def test_the_parameter_server_strategy_names_a_bad_server_address(monkeypatch, value, words):
    # the workers' own path to the servers (no launcher, no `trainmesh env`): refused before any connection
    monkeypatch.setenv("TRAINMESH_PS_SERVERS", value)
    with pytest.raises(ValueError) as raised:
        tm.ParameterServerStrategy()._server_addresses()
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))
