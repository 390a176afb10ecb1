"""Shared by the transformers parity tests (LoRA, tensor parallel): a tiny Llama / GPT-2, a peft
LoRA model on it, its data, the one-process reference."""

from __future__ import annotations

import torch

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 16, 8, 3
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}


def base_model(family: str, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        )
        return transformers.LlamaForCausalLM(config).float()
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=1,
    )
    return transformers.GPT2LMHeadModel(config).float()


def lora_config(family: str, *, init=False):
    import peft

    # init_lora_weights=False: lora_B random, not zero, so every adapter moves from the first step
    return peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=TARGETS[family],
        init_lora_weights=init,
        fan_in_fan_out=family == "gpt2",
    )


def lora_model(family: str, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    import peft

    model = base_model(family, seed, layers)
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(model, lora_config(family))


def data():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(outputs, targets):
    logits = outputs.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-5)


def make_sgd(params):
    # For adapters that start with lora_B = 0 (peft's default): lora_A's first gradients are tiny and
    # Adam divides them by their own size, so summation-order noise of 1e-7 came out as 3e-5 after 3
    # steps on one process alone. SGD keeps that comparison about the layout.
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference(family: str) -> dict:
    return train_reference(lora_model(family))


def train_reference(model: torch.nn.Module, optimizer=make_optimizer) -> dict:
    """``STEPS`` steps of a plain one-process loop over the trainable parameters."""
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    x, y = data()
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        opt.zero_grad()
        lm_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
