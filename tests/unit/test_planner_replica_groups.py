"""``trainmesh plan --replica-groups G`` (``planner/replica_groups.py``): one group's plan is every process's,
and the cross-group all-reduce is the gradient each process holds; bad input is refused before any dry run."""

from __future__ import annotations

import json

import pytest

from trainmesh.launcher.cli import main
from trainmesh.planner.parallel import plan_parallel
from trainmesh.planner.replica_groups import group_world_size

pytestmark = pytest.mark.timeout(240)
pytest.importorskip("transformers")

ARGS = ["--model", "tiny-llama", "--precision", "fp32", "--seq", "64", "--zero", "2"]


def _plan_json(capsys, argv: list[str]) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("world", "groups", "ring"), [(4, 2, 1.0), (8, 4, 1.5)])
def test_one_groups_plan_is_every_process_s(capsys, world, groups, ring):
    per_group = world // groups
    planned = _plan_json(capsys, [*ARGS, "--world-size", str(world), "--replica-groups", str(groups)])
    alone = plan_parallel("tiny-llama", world_size=per_group, zero_stage=2, precision="fp32", seq_len=64)
    summary = planned["replica_groups"]
    assert planned["world_size"] == per_group and summary["world_size"] == world
    assert summary["groups"] == groups and summary["processes_per_group"] == per_group
    # memory per process: exactly the plan of one group on its own (ZeRO-2 over the group's processes)
    assert summary["per_process_peak_bytes"] == planned["peak_bytes"] == alone.peak_bytes
    grads = max(rank.grads for rank in alone.ranks)
    assert grads < alone.num_parameters * 4  # the group's ZeRO-2 shard, not the whole gradient
    assert summary["cross_group_allreduce_bytes"] == grads
    assert summary["cross_group_wire_bytes_per_process"] == int(ring * grads)


def test_the_table_says_what_the_groups_add(capsys):
    assert main(["plan", *ARGS, "--world-size", "4", "--replica-groups", "2"]) == 0
    out = capsys.readouterr().out
    assert "replica groups (torchft): 2 groups x 2 processes = 4" in out
    assert "across groups each step all-reduces" in out


def test_bad_replica_groups_are_refused_before_a_dry_run(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *ARGS, "--world-size", "4", "--replica-groups", "3"])
    assert exc.value.code == 2
    assert "--replica-groups 3 does not divide --world-size 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "tiny-llama", "--world-size", "4", "--replica-groups", "2", "--search"])
    assert "drop --replica-groups" in capsys.readouterr().err
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="positive integer"):
            group_world_size(4, bad)
