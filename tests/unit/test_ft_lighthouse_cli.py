"""``trainmesh lighthouse``: registered, its options parsed, bad input refused before torchft starts anything."""

from __future__ import annotations

import pytest

from trainmesh.launcher import cli

pytestmark = pytest.mark.timeout(60)


def test_lighthouse_command_parses_its_options():
    args = cli.build_parser().parse_args(
        ["lighthouse", "--bind", "127.0.0.1:0", "--min-replicas", "2", "--heartbeat-timeout-ms", "1500"]
    )
    assert (args.bind, args.min_replicas, args.heartbeat_timeout_ms, args.join_timeout_ms) == (
        "127.0.0.1:0",
        2,
        1500,
        1000,
    )


def test_lighthouse_refuses_min_replicas_below_one(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["lighthouse", "--min-replicas", "0"])
    assert exited.value.code == 2
    assert "Received: --min-replicas=0" in capsys.readouterr().err
