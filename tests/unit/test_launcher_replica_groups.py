"""``trainmesh run --replica-group R --replica-groups G --lighthouse URL`` (issue 45): what the workers
receive, what one local launch starts per group, and the usage errors raised before anything starts.
The launches themselves run in tests/multiprocess/test_ft_trainer.py (a restarted group goes through
``trainmesh run --replica-group``)."""

from __future__ import annotations

import re

import pytest

from trainmesh.launcher import replica_groups
from trainmesh.launcher.cli import build_parser

pytestmark = pytest.mark.timeout(60)


def _parse(argv: list[str], tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    args = build_parser().parse_args(["run", *argv, str(script), "--lr", "0.1"])
    replica_groups.check(args, args.command_parser)
    return args, str(script)


def test_a_group_launch_hands_its_number_and_the_lighthouse_to_the_workers(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    args, _ = _parse(
        ["-n", "1", "--replica-group", "1", "--replica-groups", "2", "--lighthouse", "http://h:1"], tmp_path
    )
    assert replica_groups.worker_env(args) == {
        "TRAINMESH_REPLICA_GROUP": "1",
        "TORCHFT_LIGHTHOUSE": "http://h:1",
        "TRAINMESH_REPLICA_GROUPS": "2",
    }
    assert not replica_groups.starts_groups(args)
    args, _ = _parse(["-n", "2"], tmp_path)
    assert replica_groups.worker_env(args) == {} and not replica_groups.starts_groups(args)


def test_groups_of_two_processes_are_launched_as_two_process_jobs(tmp_path):
    args, script = _parse(["-n", "4", "--replica-groups", "2"], tmp_path)
    assert replica_groups.group_argv(args, 0, "http://127.0.0.1:5")[:2] == ["-n", "2"]


def test_a_local_job_starts_one_launch_per_group(tmp_path):
    args, script = _parse(["-n", "2", "--replica-groups", "2", "--max-restarts", "3"], tmp_path)
    assert replica_groups.starts_groups(args)
    assert replica_groups.group_argv(args, 1, "http://127.0.0.1:5") == [
        "-n", "1", "--replica-group", "1", "--replica-groups", "2", "--lighthouse", "http://127.0.0.1:5",
        "--max-restarts", "3", script, "--lr", "0.1",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "1", "--replica-group", "0"], "needs --lighthouse"),
        (["-n", "1", "--replica-group", "2", "--replica-groups", "2", "--lighthouse", "http://h:1"], "in \\[0"),
        (["-n", "3", "--replica-groups", "2"], "multiple of --replica-groups"),
        (["-n", "1", "--lighthouse", "http://h:1"], "needs --replica-group"),
        (["-n", "2", "--replica-groups", "0"], ">= 1"),
    ],
)
def test_usage_errors_before_anything_starts(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv, tmp_path)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and re.search(message, err), err
