"""The planner's expert-parallel counts (``planner/experts.py``), in one process: expert bytes per process
under EP, with and without ZeRO-3, and the clear errors raised before any dry run. The comparison with a
real EP model's bytes per process is in tests/multiprocess/test_expert_parallel.py (its 4-process launch)."""

from __future__ import annotations

import pytest
import torch

from trainmesh.planner.experts import check_plan, expert_bytes, stage_expert_paths
from trainmesh.planner.mesh_spec import MeshSpec
from trainmesh.planner.parallel import plan_parallel
from trainmesh.testing.tiny_models import tiny_qwen3_moe_config

pytestmark = pytest.mark.timeout(120)
transformers = pytest.importorskip("transformers")

HIDDEN, MOE_INTERMEDIATE, LAYERS = 16, 8, 2  # tiny_qwen3_moe_config's


def _qwen3_moe(num_experts: int = 8):
    with torch.device("meta"):
        return transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config(num_experts)).float()


def test_expert_bytes_per_process():
    model = _qwen3_moe(num_experts=8)
    per_expert = 3 * HIDDEN * MOE_INTERMEDIATE * 4  # gate, up and down projections, fp32
    whole = LAYERS * 8 * per_expert
    spec = MeshSpec.parse("data=4", 4)
    counted = expert_bytes(model, spec, expert_parallel_size=2, zero_stage=0, precision="bf16-mixed")
    assert counted["all"] == (whole, whole // 2)  # replicated in the dry run; half the experts under EP 2
    assert counted["trainable"] == counted["all"]
    assert counted["numel"] == (whole // 4, whole // 8)
    # ZeRO-3: the dry run shards each expert tensor over all 4; EP 4 holds 2 whole experts, unsharded
    assert expert_bytes(model, spec, expert_parallel_size=4, zero_stage=3, precision="32")["all"] == (whole // 4,) * 2
    # EP 2 x ZeRO-3 on 8: 4 experts per group, sharded over the 4 processes holding them; bf16-true halves
    spec8 = MeshSpec.parse("data=8", 8)
    assert expert_bytes(model, spec8, expert_parallel_size=2, zero_stage=3, precision="bf16-true")["all"] == (
        whole // 16,
        whole // 16,
    )
    # ZeRO-2: FSDP2's dim-0 shards as at ZeRO-3 (tests/multiprocess/test_planner_experts_zero2.py: a real run)
    for ep in (2, 4):
        assert expert_bytes(model, spec8, expert_parallel_size=ep, zero_stage=2, precision="32") == expert_bytes(
            model, spec8, expert_parallel_size=ep, zero_stage=3, precision="32"
        )
    # frozen experts (layer 0's): held, but without gradients or optimizer state
    frozen = _qwen3_moe(num_experts=8)
    for name, param in frozen.named_parameters():
        param.requires_grad_(".experts." not in name or "layers.0." not in name)
    counted = expert_bytes(frozen, spec, expert_parallel_size=2, zero_stage=0, precision="32")
    assert counted["trainable"] == (whole // 2, whole // 4)  # layer 1's experts only: gradients and state


def test_bad_expert_plans_are_refused_before_any_dry_run():
    moe = _qwen3_moe(num_experts=8)
    with pytest.raises(ValueError, match=r"holds 6 experts, which do not divide over mesh axis 'data' of size 4"):
        check_plan(_qwen3_moe(num_experts=6), MeshSpec.parse("data=4", 4), 4, 0)
    with pytest.raises(ValueError, match="positive divisor"):
        check_plan(moe, MeshSpec.parse("data=4", 4), 3, 0)
    # ZeRO-1 alone is refused by ModelParallel, which EP needs: named as the user passed it
    with pytest.raises(ValueError, match=r"does not offer stage 1 alone.*Received: zero_stage=1"):
        check_plan(moe, MeshSpec.parse("data=4", 4), 2, 1)
    check_plan(moe, MeshSpec.parse("data=4", 4), 2, 2)  # ZeRO-2: planned
    check_plan(moe, MeshSpec.parse("data=2,model=2", 4), 2, 0)  # EP x TP: planned
    with torch.device("meta"):
        dense = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
            )
        )
    with pytest.raises(ValueError, match="has none"):
        plan_parallel(dense, world_size=2, expert_parallel_size=2, hardware=None)


def test_pipe_by_expert_parallel_counts_the_stage_experts_at_one_over_ep():
    """Pipe 2 x EP 2 on 4: rank 0's stage holds layer 0, rank 2's layer 1 (the pipeline's own split); each
    process holds half its stage's experts: half the layers' experts at 1/2."""
    model = _qwen3_moe(num_experts=8)
    whole = LAYERS * 8 * 3 * HIDDEN * MOE_INTERMEDIATE * 4
    spec = MeshSpec.parse("pipe=2,data=2", 4)
    check_plan(model, spec, 2, 0)  # accepted: a pipe axis with EP over the batch axis
    stages = [stage_expert_paths(model, spec, rank, microbatches=2, schedule="1f1b") for rank in (0, 1, 2)]
    assert stages == [{"model.layers.0.mlp.experts"}] * 2 + [{"model.layers.1.mlp.experts"}]
    assert stage_expert_paths(model, MeshSpec.parse("data=4", 4), 0, microbatches=1, schedule="1f1b") is None
    counted = expert_bytes(model, spec, expert_parallel_size=2, zero_stage=0, precision="32", only=stages[0])
    assert counted["all"] == (whole // LAYERS, whole // LAYERS // 2)
    # ZeRO-3 within the stage: the dry run shards the stage's experts over data=2; EP 2 holds 4 whole ones
    zero3 = expert_bytes(model, spec, expert_parallel_size=2, zero_stage=3, precision="32", only=stages[2])
    assert zero3["all"] == (whole // LAYERS // 2,) * 2


def test_plan_parallel_plans_pipe_by_expert_parallel():
    """The whole planner at pipe 2 x EP 2 (a dry run of each stage; bf16: grouped_mm's meta kernel takes no
    fp32): each stage's rank holds half its one MoE layer's experts, and its all-to-alls are that layer's
    (1 count + 4 token exchanges per microbatch, 2 microbatches)."""
    whole = LAYERS * 8 * 3 * HIDDEN * MOE_INTERMEDIATE * 2
    kwargs = dict(world_size=4, mesh="pipe=2,data=2", seq_len=8, microbatches=2, hardware=None, precision="bf16-true")
    plan = plan_parallel(_qwen3_moe(8), expert_parallel_size=2, **kwargs)
    for rank in plan.ranks:
        traffic = rank.collectives.traffic[("data", "all_to_all")]
        assert traffic.count == 2 * 5
        assert traffic.bytes == 2 * (8 * 8 + 4 * 8 * 2 * HIDDEN * 2)
        assert any(
            f"{whole // 4:,} expert parameter bytes per process instead of {whole // 2:,}" in n for n in rank.notes
        )
    assert {r.rank for r in plan.ranks} == {0, 2}


def test_apply_expert_parallel_moves_expert_bytes_and_adds_the_dispatch():
    """A dry run's figures (here made up: 1000 dense bytes + the experts replicated, Adam's 2 states) become
    EP 2's, and the dispatch's all-to-alls join the rank's collectives at the uniform-routing formula."""
    from trainmesh.planner.collectives import CollectiveLog, wire_bytes
    from trainmesh.planner.dry_run import RankResult
    from trainmesh.planner.experts import apply_expert_parallel

    model = _qwen3_moe(num_experts=8)
    whole = LAYERS * 8 * 3 * HIDDEN * MOE_INTERMEDIATE * 4
    spec = MeshSpec.parse("data=4", 4)
    dry = RankResult(
        rank=0,
        coords={"data": 0},
        params=1000 + whole,
        grads=1000 + whole,
        optimizer=2 * (1000 + whole),
        activations=0,
        buffers=0,
        flops=0,
        collectives=CollectiveLog(),
        num_parameters_local=(1000 + whole) // 4,
        seconds=0.0,
    )
    tokens = 2 * 8  # micro-batch 2 x sequence 8
    planned = apply_expert_parallel(
        dry, model, spec, expert_parallel_size=2, zero_stage=0, precision="32", tokens=tokens
    )
    assert (planned.params, planned.grads, planned.optimizer) == (1000 + whole // 2,) * 2 + (2 * (1000 + whole // 2),)
    assert planned.num_parameters_local == (1000 + whole // 2) // 4
    traffic = planned.collectives.traffic[("data_expert", "all_to_all")]  # within the EP group of 2
    assert planned.collectives.group_sizes["data_expert"] == 2
    # per MoE layer: the counts (8 experts, int64), then 4 exchanges of tokens x top-2 x hidden fp32 rows
    assert traffic.count == LAYERS * 5
    assert traffic.bytes == LAYERS * (8 * 8 + 4 * tokens * 2 * HIDDEN * 4)
    token_bytes = LAYERS * 4 * tokens * 2 * HIDDEN * 4
    assert wire_bytes("all_to_all", token_bytes, 2) == token_bytes / 2  # (EP-1)/EP leave the process
    assert any(f"{whole // 2:,} expert parameter bytes per process instead of {whole:,}" in n for n in planned.notes)


def test_zero2_under_ep_holds_gathers_and_reduces_what_training_does():
    """EP x ZeRO-2 on a made-up data 4 dry run at stage 2 (the experts sharded over all 4, gathered once a step
    and reduce-scattered once, every unit gathered at once: what the dry run counts at stage 2). EP 4: the
    experts leave the batch axis's gathers, reduce-scatters and gathered buffers (FSDP2 leaves them out);
    EP 2: a quarter of them are held (half by EP, half of that over the 2 replicas), and the replicas gather
    their half once and reduce-scatter it once, one unit per experts module."""
    from trainmesh.planner.collectives import CollectiveLog
    from trainmesh.planner.dry_run import RankResult
    from trainmesh.planner.experts import apply_expert_parallel

    model = _qwen3_moe(num_experts=8)
    whole = LAYERS * 8 * 3 * HIDDEN * MOE_INTERMEDIATE * 4
    spec = MeshSpec.parse("data=4", 4)

    def dry():
        log = CollectiveLog()
        log.add("data", "all_gather", 1000 + whole, 3)
        log.add("data", "reduce_scatter", 1000 + whole, 3)
        log.group_sizes["data"] = 4
        shard = (1000 + whole) // 4
        return RankResult(0, {"data": 0}, shard, shard, 2 * shard, 0, 1000 + whole, 0, log, shard // 4, 0.0)

    ep4 = apply_expert_parallel(dry(), model, spec, expert_parallel_size=4, zero_stage=2, precision="32")
    assert (ep4.params, ep4.grads, ep4.optimizer) == (1000 // 4 + whole // 4,) * 2 + (2 * (1000 // 4 + whole // 4),)
    assert ep4.buffers == 1000
    assert {k: t.bytes for k, t in ep4.collectives.traffic.items()} == {
        ("data", "all_gather"): 1000,
        ("data", "reduce_scatter"): 1000,
    }
    ep2 = apply_expert_parallel(dry(), model, spec, expert_parallel_size=2, zero_stage=2, precision="32")
    assert (ep2.params, ep2.grads, ep2.buffers) == (1000 // 4 + whole // 4, 1000 // 4 + whole // 4, 1000 + whole // 2)
    replica = {k[1]: (t.count, t.bytes) for k, t in ep2.collectives.traffic.items() if k[0] == "data_expert_replica"}
    assert replica == {"all_gather": (LAYERS, whole // 2), "reduce_scatter": (LAYERS, whole // 2)}
    assert ep2.collectives.group_sizes["data_expert_replica"] == 2


def _dense_bytes(model) -> int:
    return sum(p.numel() * 2 for n, p in model.named_parameters() if ".experts." not in n)  # bf16-true


def _data_traffic(plan, rank: int = 0) -> dict:
    log = next(r for r in plan.ranks if r.rank == rank).collectives
    return {(axis, kind): (t.count, t.bytes, log.group_sizes.get(axis)) for (axis, kind), t in log.traffic.items()}


def test_expert_gradients_are_not_all_reduced_over_the_batch_axis():
    """Data 4 x EP 4 (the experts 64% of the model): each process holds other experts, whose gradients arrive
    whole from the dispatch's backward, so the planned batch-axis all-reduce is the dense parameters' bytes
    only (the dry run alone counted every expert too: 19,168 bytes here, not 6,880). At EP 2 the 2 processes
    holding the same experts all-reduce their half of them on their own group, and the dispatch's all-to-alls
    run within the EP group of 2."""
    model = _qwen3_moe(8)
    dense = _dense_bytes(model)
    experts = LAYERS * 8 * 3 * HIDDEN * MOE_INTERMEDIATE * 2
    kwargs = dict(world_size=4, mesh="data=4", seq_len=8, hardware="h100", precision="bf16-true", zero_stage=0)
    ep4 = _data_traffic(plan_parallel(_qwen3_moe(8), expert_parallel_size=4, **kwargs))
    assert ep4[("data", "all_reduce")] == (1, dense, 4)
    assert not any(axis.startswith("data_expert") for axis, _ in ep4)
    plan2 = plan_parallel(_qwen3_moe(8), expert_parallel_size=2, **kwargs)
    ep2 = _data_traffic(plan2)
    assert ep2[("data", "all_reduce")] == (1, dense, 4)
    assert ep2[("data_expert_replica", "all_reduce")] == (1, experts // 2, 2)
    assert ep2[("data_expert", "all_to_all")][::2] == (10, 2)
    assert ("data", "all_to_all") not in ep2
    assert set(plan2.step.axes) == {"data", "data_expert", "data_expert_replica"}  # each priced on its group


def test_zero3_under_ep_gathers_and_reduce_scatters_no_expert_over_the_batch_axis():
    """ZeRO-3 at data 4 x EP 4: FSDP2 leaves the experts out. Doubling the experts (8 -> 16) then grows the
    batch axis's gathers and reduce-scatters by the routers' new rows only (gathered twice, reduced once),
    not by the experts' 12,288 bytes (gathered twice, reduced once, in the dry run alone)."""
    kwargs = dict(world_size=4, mesh="data=4", seq_len=8, hardware=None, precision="bf16-true", zero_stage=3)
    small, large = (_data_traffic(plan_parallel(_qwen3_moe(n), expert_parallel_size=4, **kwargs)) for n in (8, 16))
    router_rows = LAYERS * 8 * HIDDEN * 2  # 8 more rows of each layer's (num_experts, hidden) gate weight
    assert large[("data", "all_gather")][1] - small[("data", "all_gather")][1] == 2 * router_rows
    assert large[("data", "reduce_scatter")][1] - small[("data", "reduce_scatter")][1] == router_rows


def test_plan_cli_takes_an_expert_parallel_size(capsys):
    """``trainmesh plan --expert-parallel-size`` reaches plan_parallel: on the dense example it is refused
    (exit 2) with the planner's own error, before any dry run."""
    from trainmesh.launcher.cli import main

    assert main(["plan", "--example", "--world-size", "2", "--expert-parallel-size", "2"]) == 2
    assert "needs a model with experts modules" in capsys.readouterr().err
