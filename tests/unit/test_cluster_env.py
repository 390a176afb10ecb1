"""detect_cluster_env: explicit args > TRAINMESH_* > torchrun > TF_CONFIG > Slurm > single.

Pure functions of their arguments and an ``environ`` mapping: no process group is started.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from trainmesh.runtime.cluster_env import (
    DEFAULT_PORT,
    ClusterEnv,
    detect_cluster_env,
    first_slurm_host,
    parse_address,
    split_job_addresses,
)

pytestmark = pytest.mark.timeout(60)


def tf_config(spec) -> dict:
    return {"TF_CONFIG": json.dumps(spec)}


# One complete description per source; each gives a different (rank, world, master) so
# the winner of any combination is unambiguous.
ARGS = dict(job_addresses="coord:4444", num_processes=6, process_id=5)
ENVS = {
    "trainmesh": {
        "TRAINMESH_RANK": "1",
        "TRAINMESH_WORLD_SIZE": "2",
        "TRAINMESH_LOCAL_RANK": "1",
        "TRAINMESH_LOCAL_WORLD_SIZE": "2",
        "TRAINMESH_MASTER_ADDR": "tm-host",
        "TRAINMESH_MASTER_PORT": "1111",
    },
    "torchrun": {
        "RANK": "2",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "tr-host",
        "MASTER_PORT": "2222",
    },
    "tf_config": tf_config(
        {
            "cluster": {"worker": ["tf0:3333", "tf1:3333", "tf2:3333", "tf3:3333"]},
            "task": {"type": "worker", "index": 3},
        }
    ),
    "slurm": {
        "SLURM_PROCID": "4",
        "SLURM_NTASKS": "5",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "4",
        "SLURM_NNODES": "5",
        "SLURM_JOB_NODELIST": "node[003-007]",
        "SLURM_JOB_ID": "4242",
    },
}
# (rank, world_size, master_addr, master_port) each source yields on its own.
EXPECTED = {
    "arguments": (5, 6, "coord", 4444),
    "trainmesh": (1, 2, "tm-host", 1111),
    "torchrun": (2, 3, "tr-host", 2222),
    "tf_config": (3, 4, "tf0", 3333),
    "slurm": (4, 5, "node003", 20000 + 4242),
}
ORDER = ["arguments", "trainmesh", "torchrun", "tf_config", "slurm"]


def _detect(sources):
    env: dict[str, str] = {}
    for s in sources:
        env.update(ENVS.get(s, {}))
    args = ARGS if "arguments" in sources else {}
    return detect_cluster_env(environ=env, **args)


def _summary(c: ClusterEnv):
    return c.source, (c.rank, c.world_size, c.master_addr, c.master_port)


# --- no source ----------------------------------------------------------------------------


def test_no_source_is_single_process():
    c = detect_cluster_env(environ={})
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.node_rank) == (0, 1, 0, 1, 0)
    assert c.source == "single"
    assert not c.is_distributed
    assert c.master_port == DEFAULT_PORT
    assert c.init_method == f"tcp://127.0.0.1:{DEFAULT_PORT}"


def test_unrelated_variables_are_single_process():
    c = detect_cluster_env(environ={"HOME": "/root", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert c.source == "single" and c.world_size == 1


def test_empty_values_count_as_unset():
    c = detect_cluster_env(environ={"RANK": "", "WORLD_SIZE": "", "TF_CONFIG": "", "SLURM_PROCID": ""})
    assert c.source == "single"


# --- each source alone and every pair -----------------------------------------------------


@pytest.mark.parametrize("source", ORDER)
def test_each_source_alone(source):
    assert _summary(_detect([source])) == (source, EXPECTED[source])


@pytest.mark.parametrize("high,low", list(itertools.combinations(ORDER, 2)), ids=lambda s: s)
def test_precedence_between_every_pair(high, low):
    assert _summary(_detect([high, low])) == (high, EXPECTED[high])
    # the order in which the variables were put into the mapping must not matter
    assert _summary(_detect([low, high])) == (high, EXPECTED[high])


def test_all_sources_at_once_arguments_win_then_trainmesh():
    assert _summary(_detect(ORDER)) == ("arguments", EXPECTED["arguments"])
    assert _summary(_detect(ORDER[1:])) == ("trainmesh", EXPECTED["trainmesh"])
    assert _summary(_detect(ORDER[2:])) == ("torchrun", EXPECTED["torchrun"])
    assert _summary(_detect(ORDER[3:])) == ("tf_config", EXPECTED["tf_config"])


# --- explicit arguments -------------------------------------------------------------------


@pytest.mark.parametrize("addresses", ["a:1,b:1,c:1", ["a:1", "b:1", "c:1"], " a:1 , b:1 , c:1 ,"])
def test_address_count_contradicting_num_processes_raises(addresses):
    with pytest.raises(ValueError, match="num_processes"):
        detect_cluster_env(job_addresses=addresses, num_processes=2, process_id=0, environ={})


def test_address_count_matching_num_processes():
    c = detect_cluster_env(job_addresses=["a:7000", "b:7000", "c:7000"], num_processes=3, process_id=2, environ={})
    assert (c.source, c.rank, c.world_size, c.master_addr, c.master_port) == ("arguments", 2, 3, "a", 7000)


def test_addresses_alone_give_world_size():
    c = detect_cluster_env(job_addresses="h0:1234,h1:1234", process_id=1, environ={})
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (1, 2, "h0", 1234)
    # distinct hosts: one process per node
    assert (c.local_rank, c.local_world_size, c.node_rank) == (0, 1, 1)


def test_addresses_on_one_host_share_the_node():
    c = detect_cluster_env(job_addresses="h:1,h:2,h:3", process_id=2, environ={})
    assert (c.local_rank, c.local_world_size, c.node_rank) == (2, 3, 0)


def test_single_coordinator_address_with_num_processes():
    c = detect_cluster_env(job_addresses="coord", num_processes=4, process_id=3, environ={})
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (3, 4, "coord", DEFAULT_PORT)


def test_ipv6_coordinator():
    c = detect_cluster_env(job_addresses="[::1]:5555", num_processes=2, process_id=0, environ={})
    assert (c.master_addr, c.master_port) == ("::1", 5555)
    assert c.init_method == "tcp://[::1]:5555"


def test_num_processes_alone_needs_a_process_id():
    with pytest.raises(ValueError, match="process_id"):
        detect_cluster_env(num_processes=2, environ={})


def test_num_processes_one_without_process_id_is_rank_zero():
    c = detect_cluster_env(num_processes=1, environ={})
    assert (c.source, c.rank, c.world_size) == ("arguments", 0, 1)


@pytest.mark.parametrize(
    "env,expected_rank",
    [
        ({"TRAINMESH_RANK": "1"}, 1),
        ({"RANK": "2"}, 2),
        ({"TRAINMESH_RANK": "3", "RANK": "1"}, 3),
    ],
)
def test_missing_process_id_is_read_from_environment(env, expected_rank):
    c = detect_cluster_env(num_processes=4, environ=env)
    assert (c.source, c.rank, c.world_size) == ("arguments", expected_rank, 4)


def test_explicit_process_id_beats_environment_rank():
    c = detect_cluster_env(num_processes=4, process_id=0, environ={"TRAINMESH_RANK": "3", "RANK": "2"})
    assert c.rank == 0


@pytest.mark.parametrize("num_processes,process_id", [(2, 2), (2, -1), (1, 1)])
def test_process_id_out_of_range_raises(num_processes, process_id):
    with pytest.raises(ValueError, match="rank"):
        detect_cluster_env(num_processes=num_processes, process_id=process_id, environ={})


@pytest.mark.parametrize("num_processes", [0, -3])
def test_num_processes_must_be_positive(num_processes):
    with pytest.raises(ValueError, match="num_processes"):
        detect_cluster_env(num_processes=num_processes, process_id=0, environ={})


# --- TRAINMESH_* and torchrun ---------------------------------------------------------------


def test_trainmesh_variables_full():
    c = detect_cluster_env(environ=ENVS["trainmesh"])
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.node_rank) == (1, 2, 1, 2, 0)
    assert c.source == "trainmesh" and c.is_distributed


def test_torchrun_variables_full():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    c = detect_cluster_env(environ=env)
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.node_rank) == (3, 4, 1, 2, 1)
    assert (c.master_addr, c.master_port, c.source) == ("127.0.0.1", DEFAULT_PORT, "torchrun")


def test_torchrun_group_rank_is_the_node_rank():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "7"}
    assert detect_cluster_env(environ=env).node_rank == 7


def test_torchrun_without_local_rank_assumes_one_node():
    c = detect_cluster_env(environ={"RANK": "2", "WORLD_SIZE": "3"})
    assert (c.local_rank, c.local_world_size, c.node_rank) == (2, 3, 0)


def test_torchrun_rank_out_of_range_raises():
    with pytest.raises(ValueError, match="rank"):
        detect_cluster_env(environ={"RANK": "4", "WORLD_SIZE": "4"})


@pytest.mark.parametrize(
    "base,name",
    [
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT"),
        ({"TRAINMESH_WORLD_SIZE": "2"}, "TRAINMESH_RANK"),
        ({"TRAINMESH_RANK": "0"}, "TRAINMESH_WORLD_SIZE"),
        ({"SLURM_NTASKS": "2"}, "SLURM_PROCID"),
        ({"SLURM_PROCID": "0"}, "SLURM_NTASKS"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_JOB_ID"),
    ],
)
@pytest.mark.parametrize("bad", ["abc", "1.5", "two"])
def test_non_integer_variable_is_value_error_naming_it(base, name, bad):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        detect_cluster_env(environ={**base, name: bad})


def test_non_integer_rank_raises_even_when_process_id_must_come_from_env():
    with pytest.raises(ValueError, match="RANK"):
        detect_cluster_env(num_processes=2, environ={"RANK": "x"})


# --- TF_CONFIG -----------------------------------------------------------------------------


def test_tf_config_worker():
    c = detect_cluster_env(
        environ=tf_config({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}})
    )
    assert (c.source, c.rank, c.world_size, c.master_addr, c.master_port) == ("tf_config", 1, 2, "a", 1)
    assert (c.local_rank, c.local_world_size, c.node_rank) == (0, 1, 1)


@pytest.mark.parametrize(
    "task,rank",
    [({"type": "chief", "index": 0}, 0), ({"type": "worker", "index": 0}, 1), ({"type": "worker", "index": 1}, 2)],
)
def test_tf_config_chief_is_rank_zero(task, rank):
    spec = {"cluster": {"chief": ["c:9"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]}, "task": task}
    c = detect_cluster_env(environ=tf_config(spec))
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (rank, 3, "c", 9)


def test_tf_config_local_rank_from_shared_hosts():
    spec = {"cluster": {"worker": ["h:1", "h:2", "g:1"]}, "task": {"type": "worker", "index": 1}}
    c = detect_cluster_env(environ=tf_config(spec))
    assert (c.local_rank, c.local_world_size, c.node_rank) == (1, 2, 0)
    spec["task"]["index"] = 2
    c = detect_cluster_env(environ=tf_config(spec))
    assert (c.local_rank, c.local_world_size, c.node_rank) == (0, 1, 1)


@pytest.mark.parametrize(
    "raw",
    [
        "{not json",
        "[1, 2]",
        "null",
        json.dumps({"task": {"type": "worker", "index": 0}}),
        json.dumps({"cluster": {"chief": ["c:1"]}, "task": {"type": "chief", "index": 0}}),
        json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "first"}}),
        json.dumps({"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}),
        json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}),
        json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": -1}}),
        json.dumps({"cluster": {"worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "ps", "index": 0}}),
        json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "evaluator", "index": 0}}),
    ],
    ids=[
        "bad-json",
        "list",
        "null",
        "no-cluster",
        "no-worker-key",
        "non-int-index",
        "no-workers",
        "index-past-end",
        "negative-index",
        "ps",
        "evaluator",
    ],
)
def test_malformed_tf_config_is_value_error_naming_it(raw):
    with pytest.raises(ValueError, match="TF_CONFIG"):
        detect_cluster_env(environ={"TF_CONFIG": raw})


# Every member of a TF_CONFIG cluster must get a distinct rank: a task that lands on another
# task's rank would make two processes join the process group as the same rank.
@pytest.mark.parametrize(
    "spec",
    [
        {"cluster": {"worker": ["w0:1", "w1:1"]}, "task": {"type": "chief", "index": 0}},
        {"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}, "task": {"type": "chief", "index": 1}},
    ],
    ids=["chief-task-without-chief-entry", "chief-index-past-chief-list"],
)
def test_tf_config_chief_index_outside_chief_list_raises(spec):
    with pytest.raises(ValueError, match="TF_CONFIG"):
        detect_cluster_env(environ=tf_config(spec))


def test_tf_config_negative_worker_index_with_chief_raises():
    spec = {"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}, "task": {"type": "worker", "index": -1}}
    with pytest.raises(ValueError, match="TF_CONFIG"):
        detect_cluster_env(environ=tf_config(spec))


@pytest.mark.parametrize(
    "workers", ["ab", "h:1", [1234], [""]], ids=["str", "str-with-port", "int-entry", "empty-entry"]
)
def test_tf_config_malformed_worker_entries_name_tf_config(workers):
    spec = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": 0}}
    with pytest.raises(ValueError, match="TF_CONFIG"):
        detect_cluster_env(environ=tf_config(spec))


# --- Slurm ---------------------------------------------------------------------------------


def test_slurm_full():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[12-13]",
        "SLURM_JOB_ID": "1234567",
    }
    c = detect_cluster_env(environ=env)
    assert (c.source, c.rank, c.world_size, c.local_rank, c.local_world_size, c.node_rank) == ("slurm", 3, 4, 1, 2, 1)
    assert (c.master_addr, c.master_port) == ("gpu12", 20000 + 1234567 % 10000)


def test_slurm_master_overrides_and_defaults():
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    c = detect_cluster_env(environ=base)
    assert (c.master_addr, c.master_port) == ("127.0.0.1", 20000)
    c = detect_cluster_env(environ={**base, "SLURM_JOB_NODELIST": "n1", "MASTER_ADDR": "m", "MASTER_PORT": "7"})
    assert (c.master_addr, c.master_port) == ("m", 7)


def test_slurm_two_jobs_get_different_ports():
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    p1 = detect_cluster_env(environ={**base, "SLURM_JOB_ID": "100"}).master_port
    p2 = detect_cluster_env(environ={**base, "SLURM_JOB_ID": "101"}).master_port
    assert p1 != p2


@pytest.mark.parametrize(
    "nodelist,first",
    [
        ("node[003-005]", "node003"),
        ("node[003-005,9],gpu1", "node003"),
        ("node[7,3-5]", "node7"),
        ("gpu1,gpu2", "gpu1"),
        ("single", "single"),
        (" host-a[01-02] ", "host-a01"),
    ],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


# --- helpers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address,expected",
    [
        ("host:1234", ("host", 1234)),
        ("host", ("host", DEFAULT_PORT)),
        (" 10.0.0.1:80 ", ("10.0.0.1", 80)),
        ("[::1]:99", ("::1", 99)),
        ("[fe80::1]", ("fe80::1", DEFAULT_PORT)),
    ],
)
def test_parse_address(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["", "   ", "host:port", "a:1:2", ":80"])
def test_parse_address_rejects_garbage(address):
    with pytest.raises(ValueError):
        parse_address(address)


def test_split_job_addresses():
    assert split_job_addresses(None) == []
    assert split_job_addresses("a:1, b:2,,") == ["a:1", "b:2"]
    assert split_job_addresses(["a:1", " ", "b:2 "]) == ["a:1", "b:2"]


def test_cluster_env_is_frozen_and_validated():
    c = detect_cluster_env(environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rank = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="world_size"):
        ClusterEnv(0, 0, 0, 1, 0, "h", 1, "x")
    with pytest.raises(ValueError, match="local_rank"):
        ClusterEnv(0, 2, 2, 2, 0, "h", 1, "x")


def test_detect_reads_os_environ_by_default(monkeypatch):
    for name in ("TRAINMESH_RANK", "TRAINMESH_WORLD_SIZE", "TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    c = detect_cluster_env()
    assert (c.source, c.rank, c.world_size) == ("torchrun", 1, 3)


# --- torchrun's elastic agent and Slurm task counts -------------------------------------------


def test_under_elastic_agent_torchrun_outranks_stale_trainmesh_variables():
    env = {**ENVS["trainmesh"], **ENVS["torchrun"], "TORCHELASTIC_RUN_ID": "job-1"}
    assert _summary(detect_cluster_env(environ=env)) == ("torchrun", EXPECTED["torchrun"])
    # explicit arguments still win
    assert _summary(detect_cluster_env(environ=env, **ARGS)) == ("arguments", EXPECTED["arguments"])
    # the agent's marker alone, without torchrun's rank variables, changes nothing
    env = {**ENVS["trainmesh"], "TORCHELASTIC_RUN_ID": "job-1"}
    assert _summary(detect_cluster_env(environ=env)) == ("trainmesh", EXPECTED["trainmesh"])


@pytest.mark.parametrize(
    "extra,local_world",
    [
        ({"SLURM_NTASKS_PER_NODE": "2"}, 2),
        ({"SLURM_NTASKS_PER_NODE": "2(x3)"}, 2),
        ({"SLURM_NNODES": "3"}, 2),
        ({}, 6),
    ],
)
def test_slurm_tasks_per_node(extra, local_world):
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2", **extra}
    c = detect_cluster_env(environ=env)
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.node_rank) == (5, 6, 1, local_world, 2)
