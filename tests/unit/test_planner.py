"""The memory planner on one process: exact byte counts, optimizer state, precision, meta-only, budget."""

from __future__ import annotations

import resource

import pytest
import torch
from torch import nn

from trainmesh.planner import format_bytes, parse_bytes, plan

pytestmark = pytest.mark.timeout(60)


def mlp():  # 2 Linear layers: (64*32 + 32) + (32*16 + 16) = 2080 + 528 = 2608 parameters
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))


def rows_by_stage(report):
    return {(r.zero_stage, r.activation_checkpointing): r for r in report.rows}


def test_exact_bytes_per_stage_for_a_small_mlp():
    n = 2
    report = plan(mlp, world_size=n, micro_batch=4, example_input=torch.zeros(4, 64), budget_bytes="1MiB")
    rows = rows_by_stage(report)
    P = 2608 * 4  # fp32 parameters
    adam = 2 * P + 4 * 4  # exp_avg + exp_avg_sq + a 4-byte step per parameter tensor (4 tensors)
    # dim-0 shards: weight (32,64) -> 16 rows, bias 32 -> 16, weight (16,32) -> 8 rows, bias 16 -> 8
    shard = (16 * 64 + 16 + 8 * 32 + 8) * 4
    adam_shard = 2 * shard + 4 * 4  # scalars stay whole
    # activations: the input (4,64) saved by Linear, ReLU output (4,32) saved by ReLU and the 2nd Linear
    # (one storage), and the output (4,16)
    acts = (4 * 64 + 4 * 32 + 4 * 16) * 4
    r0 = rows[(0, None)]
    assert (r0.params, r0.grads, r0.optimizer, r0.activations, r0.buffers) == (P, P, adam, acts, P)
    assert r0.total == P + adam + P + max(P, acts)
    largest_unit_grad = (64 * 32 + 32) * 4
    # stages 1 and 2 are the same FSDP2 layout (they differ only under accumulation): dim-0 shards,
    # every unit gathered from forward to backward + the largest unsharded gradient
    for stage in (1, 2):
        r = rows[(stage, None)]
        assert (r.params, r.grads, r.optimizer, r.buffers) == (shard, shard, adam_shard, P + largest_unit_grad)
    r3 = rows[(3, None)]
    # root unit holds nothing (both Linears are blocks): the gathered block and the prefetched next one
    # (here: both) + the largest unsharded gradient
    assert (r3.params, r3.grads, r3.optimizer, r3.buffers) == (shard, shard, adam_shard, P + largest_unit_grad)
    assert all(r.fits for r in report.rows) and report.best().zero_stage == 0


def test_adam_vs_sgd_state():
    kw = dict(world_size=1, zero_stage=0, micro_batch=2, example_input=torch.zeros(2, 64))
    P = 2608 * 4
    assert plan(mlp, optimizer="adam", **kw).rows[0].optimizer == 2 * P + 16
    assert plan(mlp, optimizer="sgd", **kw).rows[0].optimizer == P  # momentum_buffer
    assert plan(mlp, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), **kw).rows[0].optimizer == 0
    assert plan(mlp, optimizer=lambda ps: torch.optim.Adam(ps, amsgrad=True), **kw).rows[0].optimizer == 3 * P + 16


def test_bf16_true_halves_bytes_and_mixed_keeps_fp32_states():
    kw = dict(world_size=1, zero_stage=0, micro_batch=8, example_input=torch.zeros(8, 64))
    fp32, true = plan(mlp, precision="fp32", **kw).rows[0], plan(mlp, precision="bf16-true", **kw).rows[0]
    assert (true.params, true.grads) == (fp32.params // 2, fp32.grads // 2)
    assert true.optimizer == (fp32.optimizer - 16) // 2 + 16  # steps stay fp32 scalars
    assert true.activations == fp32.activations // 2
    mixed = plan(mlp, precision="bf16-mixed", **kw).rows[0]
    assert (mixed.params, mixed.grads, mixed.optimizer) == (fp32.params, fp32.grads, fp32.optimizer)


def test_gpt_rows_checkpointing_and_transformer_activations_match_a_real_forward():
    from trainmesh.demo.char_gpt import CharGPT, GPTConfig

    config = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, d_model=128)
    report = plan(lambda: CharGPT(config), world_size=2, micro_batch=8, seq_len=64)
    assert [(r.zero_stage, r.activation_checkpointing) for r in report.rows] == [
        (s, c) for s in range(4) for c in (None, "full")
    ]
    rows = rows_by_stage(report)
    # Measured on real CPU tensors with the same saved_tensors_hooks count (flash SDPA, no T x T matrix):
    assert rows[(0, None)].activations == 8954368 + 8 * 64 * 65 * 4
    # 2 blocks: kept block inputs + one block recomputed at a time, about 60% of no checkpointing here
    assert rows[(0, "full")].activations < 0.7 * rows[(0, None)].activations
    assert rows[(0, None)].params == sum(p.numel() for p in CharGPT(config).parameters()) * 4  # tied head once


def test_every_k_policy_uses_the_checkpointing_modules_paths():
    from trainmesh.demo.char_gpt import CharGPT, GPTConfig

    config = GPTConfig(vocab_size=65, block_size=32, n_layer=4, n_head=2, d_model=64)
    acts = {
        p: plan(
            lambda: CharGPT(config), world_size=1, zero_stage=0, micro_batch=2, seq_len=32, activation_checkpointing=p
        )
        .rows[-1]
        .activations
        for p in ("full", "every:2")
    }
    none = plan(lambda: CharGPT(config), world_size=1, zero_stage=0, micro_batch=2, seq_len=32).rows[0].activations
    assert acts["full"] < acts["every:2"] < none


def test_meta_device_only_a_10b_parameter_model_plans_instantly():
    def huge():  # 40 layers of 16384 x 16384: 10.7B parameters, 43 GB in fp32
        return nn.Sequential(*[nn.Linear(16384, 16384, bias=False) for _ in range(40)])

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    report = plan(huge, world_size=8, zero_stage=3, micro_batch=1, example_input=torch.zeros(1, 16384))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert report.num_parameters == 40 * 16384**2
    assert report.rows[0].params == 40 * 16384**2 * 4 // 8
    assert grown_mib < 500, f"peak RSS grew by {grown_mib:.0f} MiB: something was allocated for real"


def test_instance_is_copied_not_touched_and_tied_weights_count_once():
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100, bias=False))
    model[1].weight = model[0].weight
    report = plan(model, world_size=1, zero_stage=0, micro_batch=2, seq_len=5)
    assert report.rows[0].params == 100 * 16 * 4
    assert model[0].weight.device.type == "cpu"


def test_budget_flags_best_and_units():
    report = plan(mlp, world_size=4, micro_batch=4, example_input=torch.zeros(4, 64), budget_bytes=40_000)
    fits = {r.zero_stage: r.fits for r in report.rows}
    assert fits[0] is False and fits[3] is True
    assert report.best().fits and report.best(10) is None
    assert "no" in report.table() and "yes" in report.table()
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("1.5 GB") == 1_500_000_000
    assert format_bytes(1536) == "1.50 KiB"
    with pytest.raises(ValueError, match="Received"):
        parse_bytes("eight gigs")


def test_user_errors_name_the_value():
    with pytest.raises(ValueError, match="example_input is required"):
        plan(mlp, world_size=2, micro_batch=2)
    with pytest.raises(ValueError, match="zero_stage"):
        plan(mlp, world_size=2, micro_batch=2, zero_stage=4, example_input=torch.zeros(2, 64))
    with pytest.raises(ValueError, match="precision"):
        plan(mlp, world_size=2, micro_batch=2, precision="fp8", example_input=torch.zeros(2, 64))
