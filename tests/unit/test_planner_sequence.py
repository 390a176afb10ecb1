"""The planner's sequence axis (``planner/sequence.py``), one process, no dry run: the mesh the dry run
uses, the K/V traffic against a hand computation, and the refusals raised before anything is built.
(The activation bytes it plans are checked against real runs in tests/multiprocess/test_context_parallel.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainmesh.planner.sequence import sequence_axis_plan


@pytest.mark.parametrize(
    "mesh,world,dry",
    [
        ("data=2,seq=4", 8, "data=8"),
        ("seq=4,data=2", 8, "data=8"),
        ("seq=4", 4, "data=4"),
        ("data=2,seq=2,model=2", 8, "data=4,model=2"),
        ("seq=2,model=4", 8, "data=2,model=4"),
        # beside a pipe axis (trained as in tests/multiprocess/test_context_parallel_pipe.py): each stage holds
        # the chunk's activations, so the pipeline is dry-run at the chunk's length
        ("pipe=2,seq=2", 4, "pipe=2,data=2"),
        ("pipe=2,data=2,seq=2", 8, "pipe=2,data=4"),
    ],
)
def test_the_sequence_axis_joins_the_batch_axis_at_a_shorter_sequence(mesh, world, dry):
    plan = sequence_axis_plan(mesh, world_size=world, seq_len=4096)
    assert plan.spec.text() == dry and plan.spec.world_size == world
    assert plan.local_seq_len == 4096 // plan.size
    assert plan.user_spec.text() == mesh


def test_no_sequence_axis_no_change():
    assert sequence_axis_plan("data=4", world_size=4, seq_len=100) is None
    assert sequence_axis_plan("data=4,seq=1", world_size=4, seq_len=100) is None


def test_kv_traffic_by_hand():
    plan = sequence_axis_plan("seq=4", world_size=4, seq_len=1024)
    config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, hidden_size=512)
    # Ulysses (8 heads over 4): Q, O of 8 heads and K, V of 4 heads, 3/4 of each process's
    # [2 rows x 256 tokens x 64 head dim x 2 bytes] leaves it
    assert plan.kv_traffic(config, 2, 2) == ("ulysses", (2 * 8 + 2 * 4) * 2 * 256 * 64 * 2 * 3 // 4)
    # ring (6 heads do not divide over 4): K and V of the 3 other processes' chunks, 2 kv heads each
    config = SimpleNamespace(num_attention_heads=6, num_key_value_heads=2, hidden_size=384)
    assert plan.kv_traffic(config, 2, 2) == ("ring", 2 * 2 * 2 * 256 * 64 * 2 * 3)
    # beside a model axis of 2: this process's 4 of 8 query heads and 2 of 4 K/V heads; 2 K/V heads do not
    # divide over 4, so Ulysses repeats them to the 4 query heads first
    config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, hidden_size=512)
    assert plan.kv_traffic(config, 2, 2, tp=2) == ("ulysses", (2 * 4 + 2 * 4) * 2 * 256 * 64 * 2 * 3 // 4)


@pytest.mark.parametrize(
    "mesh,world,seq_len,sp,message",
    [
        ("data=2,seq=4", 8, 100, False, "divisible by 8"),
        ("data=2,seq=4", 8, None, False, "--seq-len must be given"),
        ("pipe=2,seq=2", 4, 66, False, "divisible by 4"),
        ("seq=2,data=2", 4, 64, True, "model axis of size > 1"),
        ("data=4", 4, 64, True, "model axis of size > 1"),
        ("seq=2,cp=2", 4, 64, False, "At most one sequence axis"),
    ],
)
def test_refusals_name_the_problem(mesh, world, seq_len, sp, message):
    with pytest.raises(ValueError, match=message):
        sequence_axis_plan(mesh, world_size=world, seq_len=seq_len, sequence_parallel=sp)


def test_sequence_parallelism_beside_a_sequence_axis():
    """As training takes it: the dry run's mesh merges seq into the batch axis and keeps sequence parallelism
    on the model axis, and the activations are those of this process's chunk."""
    from trainmesh.planner.sequence import _SequenceParallelMesh

    plan = sequence_axis_plan("seq=2,model=2", world_size=4, seq_len=64, sequence_parallel=True)
    assert plan.sequence_parallel and isinstance(plan.spec, _SequenceParallelMesh)
    assert (plan.axis, plan.size, plan.local_seq_len) == ("seq", 2, 32)
    assert not sequence_axis_plan("seq=2,model=2", world_size=4, seq_len=64).sequence_parallel


def test_plan_parallel_refuses_before_building_the_model():
    from trainmesh.planner.parallel import plan_parallel

    def never():
        raise AssertionError("the model was built")

    with pytest.raises(ValueError, match="divisible by 4"):
        plan_parallel(never, world_size=4, mesh="pipe=2,seq=2", seq_len=66)


def test_search_proposes_the_smallest_sequence_axis_that_fits():
    """tiny-llama at 2,048 tokens, fp32, ZeRO-3 on 4 processes: data=4 plans 221 MB a process, data=2,seq=2
    122 MB and seq=4 72 MB; under 100 MB the search tries seq=2, then proposes seq=4 and says why."""
    from trainmesh.planner.search import search, with_sequence_axis

    assert with_sequence_axis("pipe=2,data=4,model=2", 2) == "pipe=2,data=2,seq=2,model=2"
    assert with_sequence_axis("data=2", 4) is None
    result = search(
        "tiny-llama",
        world_size=4,
        device_memory=100 * 10**6,
        zero_stages=(3,),
        checkpointing_choices=(None,),
        max_model=1,
        max_pipe=1,
        micro_batch=1,
        seq_len=2048,
        precision="fp32",
    )
    assert [p.mesh.text() for p in result.plans] == ["data=4", "data=2,seq=2", "seq=4"]
    assert [p.fits for p in result.plans] == [False, False, True]
    assert result.best.mesh.text() == "seq=4"
    assert "seq=4, the smallest that fits" in result.proposal and "512 of them" in result.proposal
    assert result.proposal in result.table() and result.to_dict()["proposal"] == result.proposal
