"""The planner and the ZeRO memory formula with frozen parameters and mixed dtypes (one process).

A peft LoRA Llama whose frozen base is bf16 and whose adapters are fp32, under bf16-mixed: the base
counts 2 bytes a parameter, sharded at ZeRO-3 like the rest, with no gradient, no optimizer state
and no unsharded gradient; the adapters count as any trainable fp32 parameter. Checked by exact
arithmetic on the model's shapes, against the bytes a real one-process step holds, and against full
fine-tuning of the same model in fp32.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainmesh.planner import plan

pytestmark = pytest.mark.timeout(120)
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SEQ, BATCH = 8, 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama(dtype: torch.dtype = torch.float32) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def lora(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """As users write it: the base cast first, then peft (which keeps the adapters fp32)."""
    return peft.get_peft_model(llama(dtype), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))


def _row(model: nn.Module, stage: int, world_size: int = 2, optimizer="adamw"):
    report = plan(
        model,
        world_size=world_size,
        zero_stage=stage,
        precision="bf16-mixed",
        micro_batch=BATCH,
        seq_len=SEQ,
        optimizer=optimizer,
    )
    return report, next(r for r in report.rows if r.activation_checkpointing is None)


def _shard_bytes(p: torch.Tensor, world_size: int, itemsize: int | None = None) -> int:
    """Rank 0's dim-0 shard (FSDP2's chunks: the first is the largest)."""
    return math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) * (itemsize or p.element_size())


def _adam_bytes(params: list[torch.Tensor], world_size: int = 1) -> int:
    """exp_avg + exp_avg_sq in fp32 (sharded as their parameter) + a 4-byte step per tensor."""
    return sum(2 * _shard_bytes(p, world_size, 4) + 4 for p in params)


def _split(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    return frozen, trainable, sum(b.numel() * b.element_size() for b in model.buffers())


def test_the_model_is_what_users_get():
    frozen, trainable, _ = _split(lora())
    assert {p.dtype for p in frozen} == {torch.bfloat16} and {p.dtype for p in trainable} == {torch.float32}


def test_frozen_bf16_base_counted_at_two_bytes_with_no_gradient_or_optimizer_state():
    model = lora()
    frozen, trainable, buffers = _split(model)
    report, ddp = _row(model, 0)
    assert ddp.params == sum(p.numel() * 2 for p in frozen) + sum(p.numel() * 4 for p in trainable) + buffers
    assert ddp.grads == sum(p.numel() * 4 for p in trainable)
    assert ddp.optimizer == _adam_bytes(trainable)
    assert ddp.buffers == ddp.grads  # DDP's buckets hold the adapters' gradients only
    # ZeRO-3 on 2 processes: every parameter, frozen or not, sharded along dim 0 at its own dtype
    _, zero3 = _row(model, 3)
    assert zero3.params == sum(_shard_bytes(p, 2) for p in model.parameters()) + buffers
    assert zero3.grads == sum(_shard_bytes(p, 2) for p in trainable)
    assert zero3.optimizer == _adam_bytes(trainable, 2)
    assert report.num_trainable == sum(p.numel() for p in trainable)
    assert "frozen parameters (bfloat16) are counted at their own dtype" in str(report)


def test_zero3_working_buffers_gather_the_base_as_stored_and_unshard_trainable_gradients_only():
    model = lora()
    _, row = _row(model, 3)
    layers = model.base_model.model.model.layers
    in_layers = {id(p) for p in layers.parameters()}

    def unsharded(params, trainable_only=False, itemsize=None):
        return sum(
            math.ceil(p.shape[0] / 2) * 2 * (p.numel() // p.shape[0]) * (itemsize or p.element_size())
            for p in params
            if p.requires_grad or not trainable_only
        )

    # the frozen input embedding is its own unit, freed after its forward (zero.py): not held while the
    # blocks run, and smaller than the two blocks gathered beside the root then
    embedding = model.get_input_embeddings().weight
    in_layers.add(id(embedding))
    root = unsharded(p for p in model.parameters() if id(p) not in in_layers)
    blocks = sorted((unsharded(layer.parameters()) for layer in layers), reverse=True)
    assert unsharded([embedding]) < blocks[1]
    largest_grad = max(unsharded(layer.parameters(), trainable_only=True) for layer in layers)
    # the root and the two largest units gathered (computing + prefetched), one unit's unsharded gradient
    assert row.buffers == root + sum(blocks[:2]) + largest_grad
    # the same model all fp32 (LoRA on an fp32 base): gathered in bf16, as bf16-mixed always did
    fp32 = lora(torch.float32)
    _, row32 = _row(fp32, 3)
    kept = [p for p in fp32.parameters() if p is not fp32.get_input_embeddings().weight]  # all but the embedding
    gathered = unsharded(kept, itemsize=2)
    assert row32.buffers == gathered + largest_grad


def test_lora_against_full_fine_tuning():
    full_model, lora_model = llama(torch.float32), lora(torch.bfloat16)
    frozen, adapters, buffers = _split(lora_model)
    n_base, n_lora = sum(p.numel() for p in frozen), sum(p.numel() for p in adapters)
    assert n_base == sum(p.numel() for p in full_model.parameters())
    for stage, world in ((0, 1), (3, 2)):
        _, full = _row(full_model, stage, world)
        _, lo = _row(lora_model, stage, world)
        full_buffers = sum(b.numel() * b.element_size() for b in full_model.buffers())
        # full fine-tuning: 4 bytes of fp32 weights, 4 of gradient, 8 of Adam state a parameter (over the world)
        assert full.params == 4 * n_base // world + full_buffers
        assert full.grads == 4 * n_base // world
        assert full.optimizer == 8 * n_base // world + 4 * len(list(full_model.parameters()))
        # LoRA on a bf16 base: 2 bytes a base parameter, and gradients and Adam state for the adapters only
        assert lo.params == (2 * n_base + 4 * n_lora) // world + buffers
        assert lo.grads == 4 * n_lora // world
        assert lo.optimizer == 8 * n_lora // world + 4 * len(adapters)
        assert lo.model_states < 0.5 * full.model_states  # here 0.31: the adapters are 15% of the base


def test_tensor_parallel_plan_holds_the_bf16_base_shards_at_two_bytes():
    """LayoutMap.auto on a (data=1, model=2) mesh: transformers' plan (q/k/v/gate/up and lm_head by
    output, o/down by input) on the base; lora_B split with a column-parallel base, lora_A with a
    row-parallel one, the other factor whole (``distribution/adapters.py``)."""
    from trainmesh.planner import plan_parallel

    model = lora()
    columns, rows = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"), ("o_proj", "down_proj")

    def split(name: str) -> bool:
        if "lora_B" in name:
            return any(f".{c}." in name for c in columns)
        if "lora_A" in name:
            return any(f".{r}." in name for r in rows)
        return any(f".{m}." in name for m in columns + rows)

    held = {n: p.numel() // (2 if split(n) else 1) * p.element_size() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    plan = plan_parallel(model, world_size=2, mesh="data=1,model=2", micro_batch=BATCH, seq_len=SEQ)
    rank = plan.ranks[0]
    assert rank.params == sum(held.values()) + _split(model)[2]
    assert rank.grads == sum(held[n] for n in trainable)
    assert rank.optimizer == 2 * sum(held[n] for n in trainable) + 4 * len(trainable)
    assert plan.num_trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.parameter_bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def test_plan_matches_the_bytes_a_real_one_process_step_holds():
    """One real AdamW step of the LoRA model under bf16 autocast, its tensors' bytes summed."""
    model = lora()
    _, row = _row(model, 0, world_size=1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    optimizer.step()
    state = sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values())
    held = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    assert (row.params, row.grads, row.optimizer) == (held, grads, state)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert {v.dtype for s in optimizer.state.values() for v in s.values() if v.dim()} == {torch.float32}


def test_gather_dtype_keeps_a_16_bit_base_as_stored_and_fp32_models_as_before():
    from trainmesh._torch.zero import build_mixed_precision, gather_dtype

    assert gather_dtype(nn.Linear(4, 4), torch.bfloat16) == torch.bfloat16  # fp32 master weights: cast to gather
    assert gather_dtype(nn.Linear(4, 4), None) is None  # fp32 precision: nothing to cast
    assert gather_dtype(lora(torch.bfloat16), torch.bfloat16) is None  # stored in 16 bits: as stored
    assert gather_dtype(lora(torch.float16), torch.bfloat16) is None
    policy = build_mixed_precision(torch.bfloat16, None, lora(torch.bfloat16))
    assert (policy.param_dtype, policy.reduce_dtype) == (None, torch.float32)  # adapters reduced in fp32
    policy = build_mixed_precision(torch.bfloat16, None, nn.Linear(4, 4))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_a_shard_unit_with_trainable_parameters_of_two_dtypes_is_named():
    from trainmesh._torch.zero import check_uniform_trainable_dtypes, select_shard_units

    model = lora(torch.bfloat16)
    units, _ = select_shard_units(model, None)
    check_uniform_trainable_dtypes(units, model)  # frozen bf16 beside trainable fp32: fine
    model.base_model.model.model.layers[1].input_layernorm.weight.requires_grad_(True)  # a bf16 one trains too
    with pytest.raises(ValueError, match=r"layers\.1.*bfloat16.*float32"):
        check_uniform_trainable_dtypes(units, model)
