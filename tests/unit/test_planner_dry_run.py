"""The dry run on torch's fake process group: 1,024 ranks, per-axis collectives, local FLOPs, bad input."""

from __future__ import annotations

import pytest
import torch

from trainmesh.planner import MeshSpec, plan_parallel, search
from trainmesh.planner.collectives import wire_bytes
from trainmesh.planner.flops import LocalFlops

pytestmark = pytest.mark.timeout(240)


def test_a_1024_rank_tp_x_fsdp_plan_files_collectives_per_axis():
    plan = plan_parallel(
        "tiny-llama",
        world_size=1024,
        mesh="data=128,model=8",
        zero_stage=3,
        activation_checkpointing="full",
        micro_batch=1,
        seq_len=64,
        precision="fp32",
    )
    rank = plan.ranks[0]
    rows = {(r["axis"], r["kind"]): r for r in rank.collectives.rows()}
    # FSDP2 over the 128-way batch axis: one all-gather per unit in forward and one per block in backward
    # (the root stays gathered from forward to backward, ``_torch/zero.py``), one reduce-scatter per unit
    # (4 blocks + the root); tensor parallel all-reduces on the 8-way axis
    assert rows[("data", "all_gather")]["group_size"] == 128 and rows[("data", "all_gather")]["count"] == 9
    assert rows[("data", "reduce_scatter")]["count"] == 5
    assert rows[("model", "all_reduce")]["group_size"] == 8 and rows[("model", "all_reduce")]["count"] > 0
    # the gathered bytes are this rank's model-axis share of the parameters (fp32): every unit once in
    # forward, the blocks (not the root: embedding, norm, head) again in backward
    sharded_total = rank.params * 128
    assert 1.1 * sharded_total < rows[("data", "all_gather")]["bytes"] < 1.9 * sharded_total
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
    plan = plan_parallel(
        "tiny-llama",
        world_size=4,
        mesh="data=4",
        zero_stage=0,
        micro_batch=1,
        seq_len=64,
        device_memory="8MiB",
        precision="fp32",
    )
    assert plan.fits is False
    note = plan.notes[-1]
    assert "over the device memory by" in note and "--zero 3" in note
    assert "does NOT fit" in plan.table()


def test_search_ranks_fitting_candidates_fastest_first():
    # tiny-llama: 3.7M parameters, 59 MB of fp32 Adam states when whole; 40 MiB rules out ZeRO 0 on one axis
    result = search(
        "tiny-llama",
        world_size=2,
        device_memory=40 * 2**20,
        micro_batch=1,
        seq_len=32,
        precision="fp32",
        zero_stages=(0, 3),
        checkpointing_choices=(None,),
    )
    ranked = result.ranked
    assert ranked and all(p.fits for p in ranked)
    assert [p.step.seconds for p in ranked] == sorted(p.step.seconds for p in ranked)
    assert any(not p.fits for p in result.plans)  # the budget is tight enough to rule some out
    assert "PLAN search" in result.table()


def test_a_3d_pipe_x_data_x_model_plan_runs_the_pipeline_split():
    plan = plan_parallel(
        "tiny-llama",
        world_size=8,
        mesh="pipe=2,data=2,model=2",
        zero_stage=3,
        micro_batch=1,
        seq_len=32,
        precision="fp32",
        microbatches=4,
    )
    first, last = plan.ranks
    assert (first.rank, last.rank) == (0, 4) and (first.in_flight, last.in_flight) == (2, 1)
    # each stage holds about half the layers: neither holds the whole model's parameters
    assert first.params + last.params < 1.3 * plan.num_parameters * 4 / 4  # 4 = data x model shards
    pipe = {r["kind"]: r for r in first.collectives.rows() if r["axis"] == "pipe"}
    # stage 0 sends one (1, 32, 256) fp32 activation per microbatch forward
    assert pipe["send_recv"]["count"] == 4 and pipe["send_recv"]["bytes"] == 4 * 32 * 256 * 4
    assert "pipe bubble" in plan.step.exposed
    for r in plan.ranks:  # 1F1B interleaves the microbatches' forwards and backwards: each op keeps its own phase
        assert 1.5 < r.ops.flops("backward") / r.ops.flops("forward") < 2.5, (
            r.ops.flops("forward"),
            r.ops.flops("backward"),
        )


def test_alpha_beta_fit_and_calibrated_hardware_round_trip(tmp_path):
    from trainmesh.planner.calibrate import fit_alpha_beta
    from trainmesh.planner.hardware import Hardware, Link, resolve_hardware

    alpha, beta = 50e-6, 2e9
    times = {s: alpha + s / beta for s in (2**12, 2**16, 2**20, 2**23)}
    fitted_alpha, fitted_beta = fit_alpha_beta(times)
    assert abs(fitted_alpha - alpha) < 1e-7 and abs(fitted_beta / beta - 1) < 1e-6
    hw = Hardware(
        name="calibrated",
        source="calibrated: test",
        flops=1e11,
        devices_per_node=1 << 30,
        intra=Link("loopback", alpha, beta),
        inter=Link("loopback", alpha, beta),
    )
    path = tmp_path / "hw.json"
    import json

    path.write_text(json.dumps(hw.to_dict()))
    assert resolve_hardware(str(path)) == hw
    with pytest.raises(ValueError, match="Received: hardware='a100'"):
        resolve_hardware("a100")


def test_search_ranks_pipe_x_data_x_model_meshes_too():
    result = search(
        "tiny-llama",
        world_size=8,
        device_memory=2**40,
        micro_batch=1,
        seq_len=32,
        precision="fp32",
        zero_stages=(3,),
        checkpointing_choices=(None,),
        max_model=2,
        max_pipe=2,
    )
    meshes = {p.mesh.text(): p for p in result.plans}
    assert set(meshes) == {"data=8", "data=4,model=2", "pipe=2,data=4", "pipe=2,data=2,model=2"}, result.skipped
    assert [p.step.seconds for p in result.ranked] == sorted(p.step.seconds for p in result.ranked)
    three_d = meshes["pipe=2,data=2,model=2"]
    assert [r.rank for r in three_d.ranks] == [0, 4] and "pipe bubble" in three_d.step.exposed
    # a stage holds about half the blocks, sharded over data x model = 4: well under a quarter of the model
    assert max(r.params for r in three_d.ranks) < 0.8 * three_d.num_parameters * 4 / 4
    assert "pipe=2,data=2,model=2" in result.table()


def test_each_op_is_priced_by_its_flops_or_bytes_plus_overhead():
    from trainmesh.planner.hardware import Hardware, Link
    from trainmesh.planner.op_costs import OpProfile, price

    a, b = torch.ones(8, 16), torch.ones(16, 4)
    with OpProfile() as prof:
        y = (a @ b).relu()
        prof.phase = "backward"
        y.t()  # a view: overhead only
    assert prof.ops("forward") == 2 and prof.ops("backward") == 1 and prof.flops() == 2 * 8 * 16 * 4
    link = Link("l", 0.0, 1e9)
    hw = Hardware(
        name="t",
        source="test",
        flops=1e9,
        devices_per_node=8,
        intra=link,
        inter=link,
        memory_bandwidth=1e9,
        op_overhead=1e-6,
    )
    seconds = price(prof, hw)
    mm = max(1024 / 1e9, (8 * 16 + 16 * 4 + 8 * 4) * 4 / 1e9)  # compute-bound: 1.024 us
    relu = 2 * 8 * 4 * 4 / 1e9  # reads and writes 128 bytes
    assert seconds["forward"] == pytest.approx(mm + relu + 2e-6, rel=1e-9)
    assert seconds["backward"] == pytest.approx(1e-6, rel=1e-9)
    assert OpProfile.from_rows(prof.rows()).counts == prof.counts


def test_attention_and_arithmetic_bound_ops_are_priced_on_their_own_measured_curves():
    from dataclasses import replace

    from trainmesh.planner.hardware import Hardware, Link
    from trainmesh.planner.op_costs import OpProfile, price

    x = torch.rand(1024) + 0.5
    q = torch.randn(1, 2, 16, 8)
    with OpProfile() as prof:
        torch.exp(x)
        torch.add(x, x)
        prof.phase = "backward"
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    kinds = sorted(key[4] for key in prof.counts)
    assert kinds == ["", "attention", "exp"]
    link = Link("l", 0.0, 1e9)
    roofline = Hardware(
        name="t", source="test", flops=1e9, devices_per_node=8, intra=link, inter=link, memory_bandwidth=1e9
    )
    exp_bytes, attention_flops = 2 * 1024 * 4, 4 * 2 * 16 * 16 * 8
    base = price(prof, roofline)
    assert base["forward"] == pytest.approx((exp_bytes + 3 * 1024 * 4) / 1e9, rel=1e-9)
    measured = replace(roofline, op_kind_curves=(("exp", ((1.0, 1e8),)), ("attention", ((1.0, 1e8),))))
    priced = price(prof, measured)
    # exp's bytes at its own 0.1 GB/s, the add's at the bandwidth; attention's FLOPs at its own rate
    assert priced["forward"] == pytest.approx(exp_bytes / 1e8 + 3 * 1024 * 4 / 1e9, rel=1e-9)
    assert priced["backward"] == pytest.approx(max(attention_flops / 1e8, base["backward"]), rel=1e-9)
    assert Hardware.from_dict(measured.to_dict()) == measured


def test_step_time_counts_every_op_and_the_cores_processes_share():
    from dataclasses import replace

    from trainmesh.planner.hardware import HARDWARE
    from trainmesh.planner.parallel import estimate_step

    plan = plan_parallel(
        "tiny-llama", world_size=4, mesh="data=4", zero_stage=0, micro_batch=1, seq_len=32, precision="fp32"
    )
    rank = plan.ranks[0]
    assert rank.ops.ops("optimizer") > 0 and rank.ops.bytes("forward") > 0
    h100 = HARDWARE["h100"]
    slower = replace(h100, op_overhead=1e-3)
    a = estimate_step(plan.ranks, plan.mesh, h100, tokens_per_rank=None, shape={})
    b = estimate_step(plan.ranks, plan.mesh, slower, tokens_per_rank=None, shape={})
    assert b.compute - a.compute == pytest.approx(1e-3 * rank.ops.ops(), rel=1e-6)
    assert set(a.phases) == {"forward", "backward", "optimizer"} and a.phases["optimizer"] > 0
    # 4 processes on 2 free cores: each gets half a core; with 2 other runnable processes, a third
    cpu = replace(slower, cores=2, devices_per_node=1 << 30)
    assert cpu.contention(4) == 2.0 and not cpu.overlaps(4) and cpu.overlaps(1) and h100.contention(64) == 1.0
    assert replace(cpu, external_load=2.0).contention(4) == pytest.approx((2 / 3) / (2 / 6))
    shared = estimate_step(plan.ranks, plan.mesh, cpu, tokens_per_rank=None, shape={})
    assert shared.seconds == pytest.approx(2 * (shared.compute + sum(shared.axes.values())), rel=1e-6)


def test_calibration_measures_per_op_figures_and_caches_them(tmp_path, monkeypatch):
    from trainmesh.planner.calibrate import calibrate, cached_calibration

    monkeypatch.setenv("TRAINMESH_CACHE_DIR", str(tmp_path))
    hw = calibrate(link=False, contention=False)  # the core-sharing probe has its own test
    assert hw.backend == "gloo" and hw.cores >= 1 and hw.op_overhead > 0 and hw.dtensor_op_overhead > 0
    rates = [r for _, r in hw.flops_curve]
    assert len(rates) == 7 and all(r > 0 for r in rates) and all(r > 0 for _, r in hw.bandwidth_curve)
    assert cached_calibration() == hw
    assert "per op" in hw.describe()


def test_measured_core_sharing_prices_the_step_and_is_named_in_the_plan():
    from dataclasses import replace

    from trainmesh.planner.calibrate_cores import slowdown_at
    from trainmesh.planner.hardware import HARDWARE
    from trainmesh.planner.parallel import estimate_step, figures_used

    curve = ((1, 1.0), (2, 1.5), (4, 3.0), (8, 7.0))
    assert slowdown_at(curve, 1) == 1.0 and slowdown_at(curve, 3) == pytest.approx(2.25)
    assert slowdown_at(curve, 16) == pytest.approx(14.0) and slowdown_at((), 8) == 1.0
    plan = plan_parallel(
        "tiny-llama", world_size=4, mesh="data=4", zero_stage=0, micro_batch=1, seq_len=32, precision="fp32"
    )
    cpu = replace(HARDWARE["h100"], op_overhead=1e-3, cores=2, devices_per_node=1 << 30, contention_curve=curve)
    # the measured curve replaces the core count's share (which would say 2.0 for 4 processes on 2 cores)
    assert (
        cpu.contention(4) == 3.0
        and cpu.shares_cores(4)
        and not replace(cpu, contention_curve=((1, 1.0), (4, 1.0))).shares_cores(4)
    )
    step = estimate_step(plan.ranks, plan.mesh, cpu, tokens_per_rank=None, shape={})
    # compute at the 4-process slowdown; the loopback figures already carry 2 processes' share (3.0 / 1.5)
    assert step.seconds == pytest.approx(3.0 * step.compute + 2.0 * sum(step.axes.values()), rel=1e-6)
    note = figures_used(cpu, plan.mesh)
    assert "4 processes per node on 2 cores: each 3.00x slower" in note and "measured" in note


@pytest.mark.timeout(240)
def test_core_sharing_probe_measures_processes_at_once():
    from trainmesh.planner.calibrate_cores import measure_contention

    curve = measure_contention(processes=(1, 2), window=0.3)
    assert [p for p, _ in curve] == [1, 2] and all(s > 0 for _, s in curve)
    with pytest.raises(ValueError, match="processes"):
        measure_contention(processes=(0,))


def test_each_collective_kind_is_priced_with_its_own_measured_figures():
    import json

    from trainmesh.planner.collectives import CollectiveLog
    from trainmesh.planner.hardware import Hardware, Link, axis_seconds

    loop, far = Link("loopback", 1e-3, 1e9), Link("far", 1e-3, 1e9)
    hw = Hardware(
        name="calibrated",
        source="calibrated: test",
        flops=1e11,
        devices_per_node=2,
        intra=loop,
        inter=far,
        backend="gloo",
        collective_costs=(("reduce_scatter", 2e-3, 0.5e9),),
    )
    log = CollectiveLog(group_sizes={"data": 2})
    log.add("data", "all_reduce", 10**6, 2)
    log.add("data", "reduce_scatter", 10**6, 3)
    # two ranks: an all-reduce and gloo's reduce-scatter (an all-reduce of the whole buffer) both send it once
    within = 2 * 1e-3 + 10**6 / 1e9 + 3 * 2e-3 + 10**6 / 0.5e9
    assert axis_seconds(log, hw, {"data": 1})["data"] == pytest.approx(within, rel=1e-9)
    # the kind's figures were measured on the intra-node link only; across nodes the link's own price it
    across = 5 * 1e-3 + 2 * 10**6 / 1e9
    assert axis_seconds(log, hw, {"data": 2})["data"] == pytest.approx(across, rel=1e-9)
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


def test_a_measured_host_link_prices_the_axes_that_cross_hosts_and_namespace_hosts_share_the_cores():
    import json
    from dataclasses import replace

    from trainmesh.planner.calibrate_hosts import with_host_link
    from trainmesh.planner.collectives import CollectiveLog
    from trainmesh.planner.hardware import Hardware, Link, axis_seconds

    loop = Link("loopback", 1e-4, 2e9)
    one_machine = Hardware(
        name="calibrated",
        source="calibrated: test",
        flops=1e11,
        devices_per_node=1 << 30,
        intra=loop,
        inter=loop,
        backend="gloo",
        cores=2,
        collective_costs=(("all_reduce", 2e-4, 1e9),),
        contention_curve=((1, 1.0), (4, 2.5)),
    )
    # all-reduce measured as a curve (wire bytes of one call -> seconds); all-gather only as a fit
    measured = (("all_reduce", ((4096, 3e-3), (2**20, 8e-3), (2**23, 70e-3))),)
    hosts = with_host_link(
        one_machine,
        Link("hosts at 1gbit", 3e-3, 150e6),
        (("all_reduce", 3e-3, 150e6), ("all_gather", 4e-4, 140e6)),
        measured,
        processes_per_host=2,
    )
    log = CollectiveLog(group_sizes={"data": 2})
    log.add("data", "all_reduce", 2 * 3 * 2**20, 2)  # two calls of 3 MiB (two ranks: 3 MiB on the wire each)
    log.add("data", "all_gather", 10**6, 1)
    within = 2 * 2e-4 + 6 * 2**20 / 1e9 + 1e-4 + 10**6 / 2 / 2e9  # loopback: the kind's own, else the link's
    on_curve = 8e-3 + (70e-3 - 8e-3) * (3 * 2**20 - 2**20) / (2**23 - 2**20)  # between the measured points
    across = 2 * on_curve + 4e-4 + 10**6 / 2 / 140e6  # between hosts: the curve, else the kind's own fit
    assert axis_seconds(log, hosts, {"data": 1})["data"] == pytest.approx(within, rel=1e-9)
    own_links = replace(hosts, inter_link_per_node=False)
    assert axis_seconds(log, own_links, {"data": 2})["data"] == pytest.approx(across, rel=1e-9)
    # a host has one link: at stride 2 its 2 processes belong to 2 data groups whose rings both cross it
    shared_curve = 8e-3 + (70e-3 - 8e-3) * (6 * 2**20 - 2**20) / (2**23 - 2**20)
    shared = 2 * shared_curve + 4e-4 + 2 * 10**6 / 2 / 140e6
    assert axis_seconds(log, hosts, {"data": 2})["data"] == pytest.approx(shared, rel=1e-9)
    assert axis_seconds(log, hosts, {"data": 2}, all_intra=True)["data"] == pytest.approx(within, rel=1e-9)
    # outside the measured sizes: the smallest's latency below, the last segment's slope above
    assert hosts.collective_seconds("all_reduce", hosts.inter, 1, 100) == pytest.approx(3e-3)
    assert hosts.collective_seconds("all_reduce", hosts.inter, 1, 2**24) == pytest.approx(
        70e-3 + (70e-3 - 8e-3) * (2**24 - 2**23) / (2**23 - 2**20)
    )
    # the namespace hosts are one machine: all 4 processes of 2 hosts share its cores
    assert hosts.processes_per_node(4) == 4 and hosts.contention(4) == pytest.approx(2.5)
    assert replace(hosts, nodes_share_cores=False).processes_per_node(4) == 2
    assert "hosts at 1gbit" in hosts.source and "2 process(es) each" in hosts.source
    assert Hardware.from_dict(json.loads(json.dumps(hosts.to_dict()))) == hosts


def test_waiting_on_a_link_between_hosts_is_not_stretched_by_the_core_share():
    """Processes that share cores ask them for the CPU cost of their traffic (its price on the link inside
    a node), stretched by the core share; what the slower link between hosts adds is waiting, added once."""
    from trainmesh.planner.calibrate_hosts import with_host_link
    from trainmesh.planner.collectives import CollectiveLog
    from trainmesh.planner.dry_run import RankResult
    from trainmesh.planner.hardware import Hardware, Link, axis_seconds
    from trainmesh.planner.mesh_spec import MeshSpec
    from trainmesh.planner.parallel import estimate_step

    loop = Link("loopback", 1e-4, 2e9)
    one_machine = Hardware(
        name="calibrated",
        source="calibrated: test",
        flops=1e10,
        devices_per_node=1 << 30,
        intra=loop,
        inter=loop,
        backend="gloo",
        cores=2,
        contention_curve=((1, 1.0), (2, 1.0), (4, 2.5)),
    )
    hosts = with_host_link(one_machine, Link("hosts at 1gbit", 3e-3, 100e6), (), (), processes_per_host=2)
    spec = MeshSpec.parse("data=2,model=2", 4)  # data stride 2: each data group has a rank on each host
    log = CollectiveLog(group_sizes={"data": 2, "model": 2})
    log.add("data", "all_reduce", 8 * 10**6, 1)
    log.add("model", "all_reduce", 10**6, 4)
    rank = RankResult(
        rank=0,
        coords={"data": 0, "model": 0},
        params=0,
        grads=0,
        optimizer=0,
        activations=0,
        buffers=0,
        flops=3 * 10**9,
        collectives=log,
        num_parameters_local=0,
        seconds=0.0,
    )
    step = estimate_step([rank], spec, hosts, tokens_per_rank=None, shape={})
    strides = {"data": 2, "model": 1}
    on_links, cpu = axis_seconds(log, hosts, strides), axis_seconds(log, hosts, strides, all_intra=True)
    assert on_links["data"] > 20 * cpu["data"] and on_links["model"] == cpu["model"]  # only data crosses hosts
    compute = 3 * 10**9 / 1e10
    slowdown = hosts.contention(4)  # 2.5, against 1.0 for the 2 processes that measured the links
    expected = compute * slowdown + sum(cpu.values()) * slowdown + (on_links["data"] - cpu["data"])
    assert step.seconds == pytest.approx(expected, rel=1e-9)
    assert step.exposed["cores shared"] == pytest.approx(expected - compute - sum(on_links.values()), rel=1e-9)


@pytest.mark.timeout(240)
def test_calibration_measures_each_collective_kind_between_two_processes():
    from trainmesh.planner.calibrate import KINDS, calibrate_collectives

    link, costs = calibrate_collectives(repeats=2, sizes=[2**12, 2**16, 2**20])
    assert [kind for kind, _, _ in costs] == list(KINDS)
    assert all(alpha >= 0 and beta > 0 for _, alpha, beta in costs)
    assert (link.alpha, link.beta) == next((a, b) for k, a, b in costs if k == "all_reduce")


def test_fsdp2_hooks_are_priced_per_gather_and_reduce_scatter_call():
    from dataclasses import replace

    from trainmesh.planner.hardware import HARDWARE
    from trainmesh.planner.parallel import estimate_step

    hooked = replace(HARDWARE["h100"], fsdp_call_overhead=1e-3)
    zero3 = plan_parallel(
        "tiny-llama", world_size=4, mesh="data=4", zero_stage=3, micro_batch=1, seq_len=32, precision="fp32"
    )
    calls = sum(
        row["count"] for row in zero3.ranks[0].collectives.rows() if row["kind"] in ("all_gather", "reduce_scatter")
    )
    step = estimate_step(zero3.ranks, zero3.mesh, hooked, tokens_per_rank=None, shape={})
    assert calls > 0 and step.phases["fsdp hooks"] == pytest.approx(calls * 1e-3, rel=1e-9)
    ddp = plan_parallel(
        "tiny-llama", world_size=4, mesh="data=4", zero_stage=0, micro_batch=1, seq_len=32, precision="fp32"
    )
    assert "fsdp hooks" not in estimate_step(ddp.ranks, ddp.mesh, hooked, tokens_per_rank=None, shape={}).phases


def test_a_dry_run_keeps_torchs_false_alarms_out_of_the_planners_output():
    """A pipe x ZeRO-3 dry run of a transformers Llama deep-copies fake tensors into its stages and
    returns a view (the logits) from an FSDP2 root: torch warns about both, neither applies to a
    dry run. They are filtered there alone; a warning of any other kind still gets through."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan_parallel(
            "tiny-llama",
            world_size=4,
            mesh="pipe=2,data=2",
            zero_stage=3,
            micro_batch=1,
            seq_len=32,
            precision="fp32",
            microbatches=2,
        )
        warnings.warn("a warning of another kind", UserWarning)
    texts = [str(w.message) for w in caught]
    assert not [t for t in texts if "data pointer of FakeTensor" in t or "returned a view tensor" in t], texts
    assert "a warning of another kind" in texts
