"""Shared by the expert-parallel tests and benchmark: tiny transformers MoE models built from a config
(no download), their data, loss, optimizer, a skewed router, and the one-process reference."""

from __future__ import annotations

import torch

VOCAB, SEQ, GLOBAL_BATCH, STEPS, NUM_EXPERTS = 64, 8, 8, 3, 4


AUX_COEF = 0.1  # large, so that the auxiliary loss moves the router visibly in 3 steps
BIAS_RATE = 0.01  # DeepSeek-V3's bias update speed, large so that steps 2-3 route differently from step 1


def moe_model(
    family: str, seed: int = 0, num_experts: int = NUM_EXPERTS, layers: int = 2, router_logits: bool = False
) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        num_experts_per_tok=2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        output_router_logits=router_logits,
    )
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=num_experts,
            head_dim=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
        return transformers.Qwen3MoeForCausalLM(config).float()
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=16, num_local_experts=num_experts, head_dim=8, **common)
        return transformers.MixtralForCausalLM(config).float()
    if family == "olmoe":  # transformers' base_model_ep_plan names its experts; q/k norms over the whole width
        config = transformers.OlmoeConfig(intermediate_size=16, num_experts=num_experts, **common)
        return transformers.OlmoeForCausalLM(config).float()
    if family == "deepseek_v3":
        # sigmoid router over 2 groups of 2 experts (top-1 group) with the e_score_correction_bias buffer,
        # a shared expert, multi-head latent attention, and a dense first layer before the MoE one. Top-1:
        # at top-2 the top group's two experts are always both chosen, so the loads come in equal pairs and
        # the bias update (BIAS_RATE) oscillated back to zero in 3 steps
        config = transformers.DeepseekV3Config(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=num_experts,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            **{**common, "num_key_value_heads": 4, "num_experts_per_tok": 1},
        )
        return transformers.DeepseekV3ForCausalLM(config).float()
    if family == "gpt_oss":  # attention sinks, biased experts with a clamped SwiGLU, sliding-window layers
        config = transformers.GptOssConfig(
            intermediate_size=16, num_local_experts=num_experts, head_dim=8, sliding_window=4, **common
        )
        return transformers.GptOssForCausalLM(config).float()
    raise ValueError(f"unknown MoE family {family!r}")


def skew_router(model: torch.nn.Module, experts=(0, 1)) -> torch.nn.Module:
    """Every token to ``experts`` (both on the first process at EP 2): the routing weights stay the
    router's own softmax over those experts, so the router still learns."""

    def hook(module, args, output):
        logits, _, _ = output
        chosen = torch.tensor(experts, device=logits.device)
        weights = torch.softmax(logits[:, chosen], dim=-1)
        return logits, weights.to(output[1].dtype), chosen.expand(logits.shape[0], -1)

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook)
    return model


def data(steps: int = STEPS, batch: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (batch * steps, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(outputs, targets):
    # cross-entropy, not .sum(): grouped_mm's backward refuses a zero-stride gradient
    logits = outputs.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def transformers_aux_loss(outputs):
    """transformers' own auxiliary loss on this process's tokens (one process: the global batch)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return load_balancing_loss_func(outputs.router_logits, NUM_EXPERTS, 2)


def make_optimizer(params):
    # eps 1e-5 as the other parity tests: Adam's step is ~lr whatever the gradient's size, so fp32
    # summation-order noise in a tiny gradient would dominate with eps 1e-8
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, eps=1e-5)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (within its mesh: a pipeline stage's), a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def recording_optimizer(first_grads: dict):
    """``make_optimizer`` whose first step first records every gradient, whole, into ``first_grads``
    (keyed by ``id`` of the parameter)."""

    def optimizer(params):
        params = list(params)
        opt = make_optimizer(params)
        step = opt.step

        def recorded(*args, **kwargs):
            if not first_grads:
                for p in params:
                    if p.grad is not None:
                        first_grads[id(p)] = whole(p.grad).detach().clone()
            return step(*args, **kwargs)

        opt.step = recorded
        return opt

    return optimizer


def fit_recording(
    model: torch.nn.Module, distribution, zero_stage: int = 0, *, loss_fn=lm_loss, batches=None, **options
) -> tuple:
    """One epoch of ``data()`` (or of ``batches``, a list of global batches) under ``tm.Trainer`` with a loss
    logged every step: ``(trainer, params, grads, logs)``, the parameters after training and the first
    step's gradients whole (within a pipeline stage), by name, and each step's log record. ``options``: more
    of the Trainer's keywords (``max_grad_norm=``)."""
    import trainmesh as tm

    first_grads: dict = {}
    logs: list = []
    trainer = tm.Trainer(
        model,
        recording_optimizer(first_grads),
        loss_fn,
        distribution=distribution,
        zero_stage=zero_stage,
        progress=False,
        log_every_n_steps=1,
        callbacks=[tm.LambdaCallback(on_train_batch_end=lambda step, record: logs.append(dict(record)))],
        **options,
    )
    if batches is None:
        trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
    else:
        trainer.fit(batches, epochs=1)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    params = {n: whole(p).detach().clone() for n, p in trainer.model.named_parameters()}
    grads = {names[i]: g for i, g in first_grads.items() if i in names}
    return trainer, params, grads, logs


def reference(
    family: str,
    skew: bool = False,
    accumulation: int = 1,
    max_norm: float | None = None,
    aux: bool = False,
    epochs: int = 1,
    bias: bool = False,
    layers: int = 2,
) -> dict:
    """Losses, first-step gradients and final parameters of one process on the global batches; ``aux``
    adds ``AUX_COEF`` x transformers' auxiliary loss to the cross-entropy; ``bias`` updates DeepSeek-V3's
    router bias after each step, written out here (not trainmesh's class): ``BIAS_RATE x sign(mean load -
    load)`` from the step's (token, expert) counts."""
    model = moe_model(family, router_logits=aux, layers=layers)
    if skew:
        skew_router(model)
    loads = {}
    if bias:
        for name, module in model.named_modules():
            if hasattr(module, "e_score_correction_bias"):
                module.register_forward_hook(
                    lambda m, a, out, name=name: loads.__setitem__(
                        name, loads.get(name, 0) + torch.bincount(out[2].reshape(-1), minlength=NUM_EXPERTS)
                    )
                )
    opt = make_optimizer(model.parameters())
    x, y = data()
    losses, grads = [], None
    for step in range(STEPS * epochs):  # epochs: the same batches again, in order (shuffle=False)
        rows = torch.arange((step % STEPS) * GLOBAL_BATCH, (step % STEPS + 1) * GLOBAL_BATCH)
        opt.zero_grad()
        total = 0.0
        for micro in rows.chunk(accumulation):
            outputs = model(x[micro])
            loss = lm_loss(outputs, y[micro])
            if aux:
                loss = loss + AUX_COEF * transformers_aux_loss(outputs)
            loss = loss / accumulation
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        if grads is None:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        with torch.no_grad():
            for name, load in loads.items():
                load = load.float()
                model.get_submodule(name).e_score_correction_bias.add_(BIAS_RATE * torch.sign(load.mean() - load))
        loads.clear()
    return {"losses": losses, "grads": grads, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def routing_counts(family: str) -> list[list[int]]:
    """One process's (token, expert) pairs per expert of each MoE layer on the first global batch."""
    model = moe_model(family)
    counts: list[list[int]] = []

    def hook(module, args, output):
        counts.append(torch.bincount(output[-1].reshape(-1), minlength=NUM_EXPERTS).tolist())

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook)
    with torch.no_grad():
        model(data()[0][:GLOBAL_BATCH])
    return counts


class DictInputs(torch.nn.Module):
    """A user's wrapper that takes dict batches (``input_ids`` + ``attention_mask``)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, batch):
        return self.lm(**batch)


def padded_batches(left: bool) -> list:
    """``data()`` as global batches of dicts with 0-6 padding tokens per row, at the end (``left=False``) or,
    on odd rows, at the start; padded inputs are the pad token, their targets -100 (so ``targets != -100``
    is the attention mask). A list of ``({"input_ids", "attention_mask"}, targets)``."""
    x, y = data()
    x, y = x.clone(), y.clone()
    mask = torch.ones_like(x)
    for row in range(len(x)):
        pad = (row * 3) % 7
        cols = slice(0, pad) if left and row % 2 else slice(SEQ - pad, SEQ)
        mask[row, cols], x[row, cols], y[row, cols] = 0, 2, -100
    return [
        ({"input_ids": x[i : i + GLOBAL_BATCH], "attention_mask": mask[i : i + GLOBAL_BATCH]}, y[i : i + GLOBAL_BATCH])
        for i in range(0, len(x), GLOBAL_BATCH)
    ]


def aux_lm_loss(distribution=None, masked: bool = False):
    """``lm_loss + AUX_COEF x`` trainmesh's global ``load_balancing_loss`` (transformers' value on one
    process), over the real tokens only when ``masked`` (their mask is ``targets != -100``, split like the
    inputs over a sequence axis)."""
    from trainmesh.moe import load_balancing_loss

    def loss_fn(outputs, targets):
        mask = (targets != -100) if masked else None
        aux = load_balancing_loss(outputs.router_logits, NUM_EXPERTS, 2, mask, distribution=distribution)
        return lm_loss(outputs, targets) + AUX_COEF * aux

    return loss_fn


def padded_reference(left: bool, aux: bool = False, masked: bool = False, max_norm: float | None = None) -> dict:
    """``reference`` on ``padded_batches(left)``: one process, the dict-taking model, the global token mean
    (plus ``aux_lm_loss`` when ``aux``), clipped to ``max_norm`` (the first step's gradients after clipping,
    as the optimizer sees them); names as ``DictInputs`` gives them."""
    model = DictInputs(moe_model("qwen3_moe", router_logits=aux))
    loss_fn = aux_lm_loss(masked=masked) if aux else lm_loss
    opt = make_optimizer(model.parameters())
    losses, grads = [], None
    for inputs, targets in padded_batches(left):
        opt.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        losses.append(float(loss.detach()))
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if grads is None:  # as the optimizer sees them (fit_recording's), clipped
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
    return {"losses": losses, "grads": grads, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
