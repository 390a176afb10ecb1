"""`trainmesh run` on several nodes: which address a node advertises, and argument checks.

Nothing here sends a packet: routes are asked of the kernel with an unsent UDP ``connect()``,
names that would need DNS are answered by a monkeypatched resolver, and "is this address
mine" is a ``bind()``. The same choice across real namespaces is in tests/multihost.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest

from trainmesh.launcher import cli, run

pytestmark = pytest.mark.timeout(60)

# TEST-NET-3 (RFC 5737): never assigned to a machine, so never one of ours.
FOREIGN = "203.0.113.7"


def parse(*argv: str):
    parser = cli.build_parser()
    args = parser.parse_args(["run", *argv])
    return args, args.command_parser


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def test_route_to_a_loopback_endpoint_is_loopback():
    assert run.choose_local_addr("127.0.0.1:29400") == "127.0.0.1"
    assert run.choose_local_addr("127.0.0.1") == "127.0.0.1"  # torchrun's default port


def test_unresolvable_rendezvous_host_is_a_value_error(monkeypatch):
    def no_such_host(*_args, **_kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    with pytest.raises(
        ValueError, match=r"cannot resolve the rendezvous host 'nohost'.*Received: --rdzv-endpoint nohost:1"
    ):
        run.choose_local_addr("nohost:1")


def test_interface_of_names_the_holder_of_an_address():
    assert run.interface_of("127.0.0.1") == "lo"
    assert run.interface_of(FOREIGN) is None


def test_worker_env_points_gloo_at_the_advertised_interface(monkeypatch):
    monkeypatch.setattr(run, "interface_of", lambda address: {"198.18.0.2": "eth0"}.get(address))
    assert run.worker_env(2, environ={}, local_addr="198.18.0.2")["GLOO_SOCKET_IFNAME"] == "eth0"
    # The user's own choice is kept, loopback needs nothing, and one node sets nothing.
    assert "GLOO_SOCKET_IFNAME" not in run.worker_env(2, environ={"GLOO_SOCKET_IFNAME": "ib0"}, local_addr="198.18.0.2")
    assert "GLOO_SOCKET_IFNAME" not in run.worker_env(2, environ={}, local_addr="127.0.0.1")
    assert "GLOO_SOCKET_IFNAME" not in run.worker_env(2, environ={}, local_addr=None)


def test_local_addr_reaches_torchrun(script):
    args, _ = parse(
        "-n", "2", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--local-addr", "127.0.0.1", script
    )
    argv = run.torchrun_argv(args)
    assert argv[argv.index("--local-addr") + 1] == "127.0.0.1"
    args, _ = parse("-n", "2", script)
    assert "--local-addr" not in run.torchrun_argv(args)


def test_default_local_addr_only_on_several_nodes(script):
    args, _ = parse("-n", "2", script)
    assert run.resolve_local_addr(args) is None  # one node: torch's own default, nothing to reach
    args, _ = parse("-n", "2", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", script)
    assert run.resolve_local_addr(args) == "127.0.0.1"
    args, _ = parse(
        "-n", "2", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--local-addr", "127.0.0.2", script
    )
    assert run.resolve_local_addr(args) == "127.0.0.2"  # as given


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "--rdzv-endpoint", "h:abc"], "--rdzv-endpoint must be HOST:PORT"),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--local-addr", FOREIGN],
            f"--local-addr must be an address of this machine.*Received: --local-addr {FOREIGN}",
        ),
        (["--nnodes", "2"], "--rdzv-endpoint HOST:PORT is required"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"], "--node-rank must be < --nnodes"),
    ],
)
def test_bad_arguments_stop_before_any_connection(script, capsys, argv, message):
    args, parser = parse("-n", "1", *argv, script)
    with pytest.raises(SystemExit) as exit_info:
        run.handle(args, parser)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_no_route_to_the_rendezvous_host_is_a_usage_error(script, capsys, monkeypatch):
    def unreachable(endpoint):
        raise ValueError(f"no route from this machine to the rendezvous host. Received: --rdzv-endpoint {endpoint}")

    monkeypatch.setattr(run, "choose_local_addr", unreachable)
    args, parser = parse("-n", "1", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", script)
    with pytest.raises(SystemExit):
        run.handle(args, parser)
    assert "no route from this machine" in capsys.readouterr().err


def test_elastic_node_range_and_rendezvous_settings_reach_torchrun(script):
    args, _ = parse(
        "-n",
        "2",
        "--nnodes",
        "1:2",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        "127.0.0.1:29400",
        "--rdzv-conf",
        "last_call_timeout=2,join_timeout=60",
        script,
    )
    argv = run.torchrun_argv(args)
    assert argv[argv.index("--nnodes") + 1] == "1:2"
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=0,last_call_timeout=2,join_timeout=60"
    assert run.resolve_local_addr(args) == "127.0.0.1"  # up to 2 nodes: a multi-node job
    assert parse("-n", "2", "--nnodes", "2:2", script)[0].nnodes == "2"
    # On several nodes the agents' store is not shared with the workers: a replacement node
    # must find every round's store address published (see run.worker_env).
    assert run.worker_env(2, environ={}, multi_node=True)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in run.worker_env(2, environ={})


@pytest.mark.parametrize("bad", ["0", "2:1", "1:2:3", "a:b", "0:2"])
def test_bad_node_range_is_refused_with_the_value(capsys, bad):
    with pytest.raises(SystemExit):
        parse("-n", "1", "--nnodes", bad, "x.py")
    assert f"Received: {bad}" in capsys.readouterr().err


def test_node_rank_checked_against_the_largest_node_count(script, capsys):
    args, parser = parse("-n", "1", "--nnodes", "1:2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1", script)
    with pytest.raises(SystemExit):
        run.handle(args, parser)
    assert "--node-rank must be < --nnodes" in capsys.readouterr().err


def test_an_empty_omp_num_threads_counts_as_unset():
    # libgomp rejects "" and every worker then runs a thread per core: 10x slower steps on 4 workers.
    from trainmesh.launcher import run

    cores = max(1, (os.cpu_count() or 1) // 2)
    assert run.worker_env(2, environ={"OMP_NUM_THREADS": ""})["OMP_NUM_THREADS"] == str(cores)
    assert run.worker_env(2, environ={})["OMP_NUM_THREADS"] == str(cores)
    assert "OMP_NUM_THREADS" not in run.worker_env(2, environ={"OMP_NUM_THREADS": "3"})
