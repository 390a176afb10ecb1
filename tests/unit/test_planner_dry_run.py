"""The dry run on torch's fake process group: 1,024 ranks, per-axis collectives, local FLOPs, bad input."""

from __future__ import annotations

import pytest
import torch

from trainmesh.planner import MeshSpec, plan_parallel, search
from trainmesh.planner.collectives import wire_bytes
from trainmesh.planner.flops import LocalFlops

pytestmark = pytest.mark.timeout(240)


def test_a_1024_rank_tp_x_fsdp_plan_files_collectives_per_axis():
    plan = plan_parallel("tiny-llama", world_size=1024, mesh="data=128,model=8", zero_stage=3,
                         activation_checkpointing="full", micro_batch=1, seq_len=64, precision="fp32")
    rank = plan.ranks[0]
    rows = {(r["axis"], r["kind"]): r for r in rank.collectives.rows()}
    # FSDP2 over the 128-way batch axis: one all-gather per unit in forward and one in backward,
    # one reduce-scatter per unit (4 blocks + the root); tensor parallel all-reduces on the 8-way axis
    assert rows[("data", "all_gather")]["group_size"] == 128 and rows[("data", "all_gather")]["count"] == 10
    assert rows[("data", "reduce_scatter")]["count"] == 5
    assert rows[("model", "all_reduce")]["group_size"] == 8 and rows[("model", "all_reduce")]["count"] > 0
    # the gathered bytes are this rank's model-axis share of the parameters, gathered twice (fp32)
    sharded_total = rank.params * 128
    assert 0.9 < rows[("data", "all_gather")]["bytes"] / (2 * sharded_total) < 1.1
    # every parameter is split 1024 ways at most (FSDP2 pads dim 0 to 128 equal rows: rank 0 holds more)
    assert plan.num_parameters * 4 / 1024 <= rank.params < plan.num_parameters * 4 / 1024 * 3
    assert plan.step.seconds > plan.step.compute > 0 and 0 < plan.step.comm_share < 1


def test_tensor_parallel_halves_each_ranks_matmul_flops():
    kw = dict(zero_stage=0, micro_batch=2, seq_len=64, precision="fp32")
    one = plan_parallel("tiny-llama", world_size=2, mesh="data=2", **kw).ranks[0].flops
    two = plan_parallel("tiny-llama", world_size=2, mesh="data=1,model=2", **kw).ranks[0].flops
    # everything but the (replicated) embedding lookup and norms is split: close to half
    assert 0.45 < two / one < 0.6, (one, two)


def test_local_flops_and_wire_bytes():
    with LocalFlops() as counter:
        torch.ones(8, 16) @ torch.ones(16, 4)
    assert counter.total == 2 * 8 * 16 * 4
    assert wire_bytes("all_reduce", 1000, 4) == 1500 and wire_bytes("all_gather", 1000, 1) == 0


def test_mesh_errors_name_the_value():
    with pytest.raises(ValueError, match=r"multiplies to 6 ranks, not the world size 8"):
        MeshSpec.parse("data=3,model=2", 8)
    with pytest.raises(ValueError, match="axis=size"):
        MeshSpec.parse("data:8", 8)
    with pytest.raises(ValueError, match="Received"):
        plan_parallel("tiny-llama", world_size=6, mesh="data=2,model=3", micro_batch=1, seq_len=16)


def test_a_plan_that_does_not_fit_says_by_how_much_and_which_knob():
    plan = plan_parallel("tiny-llama", world_size=4, mesh="data=4", zero_stage=0, micro_batch=1, seq_len=64,
                         device_memory="8MiB", precision="fp32")
    assert plan.fits is False
    note = plan.notes[-1]
    assert "over the device memory by" in note and "--zero 3" in note
    assert "does NOT fit" in plan.table()


def test_search_ranks_fitting_candidates_fastest_first():
    # tiny-llama: 3.7M parameters, 59 MB of fp32 Adam states when whole; 40 MiB rules out ZeRO 0 on one axis
    result = search("tiny-llama", world_size=2, device_memory=40 * 2**20, micro_batch=1, seq_len=32,
                    precision="fp32", zero_stages=(0, 3), checkpointing_choices=(None,))
    ranked = result.ranked
    assert ranked and all(p.fits for p in ranked)
    assert [p.step.seconds for p in ranked] == sorted(p.step.seconds for p in ranked)
    assert any(not p.fits for p in result.plans)  # the budget is tight enough to rule some out
    assert "PLAN search" in result.table()


def test_a_3d_pipe_x_data_x_model_plan_runs_the_pipeline_split():
    plan = plan_parallel("tiny-llama", world_size=8, mesh="pipe=2,data=2,model=2", zero_stage=3, micro_batch=1,
                         seq_len=32, precision="fp32", microbatches=4)
    first, last = plan.ranks
    assert (first.rank, last.rank) == (0, 4) and (first.in_flight, last.in_flight) == (2, 1)
    # each stage holds about half the layers: neither holds the whole model's parameters
    assert first.params + last.params < 1.3 * plan.num_parameters * 4 / 4  # 4 = data x model shards
    pipe = {r["kind"]: r for r in first.collectives.rows() if r["axis"] == "pipe"}
    # stage 0 sends one (1, 32, 256) fp32 activation per microbatch forward
    assert pipe["send_recv"]["count"] == 4 and pipe["send_recv"]["bytes"] == 4 * 32 * 256 * 4
    assert "pipe bubble" in plan.step.exposed


def test_alpha_beta_fit_and_calibrated_hardware_round_trip(tmp_path):
    from trainmesh.planner.calibrate import fit_alpha_beta
    from trainmesh.planner.hardware import Hardware, Link, resolve_hardware

    alpha, beta = 50e-6, 2e9
    times = {s: alpha + s / beta for s in (2**12, 2**16, 2**20, 2**23)}
    fitted_alpha, fitted_beta = fit_alpha_beta(times)
    assert abs(fitted_alpha - alpha) < 1e-7 and abs(fitted_beta / beta - 1) < 1e-6
    hw = Hardware(name="calibrated", source="calibrated: test", flops=1e11, devices_per_node=1 << 30,
                  intra=Link("loopback", alpha, beta), inter=Link("loopback", alpha, beta))
    path = tmp_path / "hw.json"
    import json

    path.write_text(json.dumps(hw.to_dict()))
    assert resolve_hardware(str(path)) == hw
    with pytest.raises(ValueError, match="Received: hardware='a100'"):
        resolve_hardware("a100")
