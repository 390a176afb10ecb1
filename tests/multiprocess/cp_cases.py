"""Shared by the context-parallel tests and benchmark: tiny Llama / Qwen3 models, token batches (plain,
padded and packed), the loss, and the one-process reference loop."""

from __future__ import annotations

import torch

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 32, 4, 3


def build_model(
    family: str = "llama", *, seed: int = 0, layers: int = 2, heads: int = 4, kv_heads: int = 2, **extra
) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=8 * heads,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        **extra,
    )
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=8 * heads,
            n_layer=layers,
            n_head=heads,
            n_positions=4096,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=1,
        )
        config._attn_implementation = "sdpa"
        return transformers.GPT2LMHeadModel(config).float()
    if family == "qwen3":
        config = transformers.Qwen3Config(head_dim=8, **common)
    elif family == "mistral":
        config = transformers.MistralConfig(**common)
    else:
        config = transformers.LlamaConfig(**common)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).float()


class Padded(torch.nn.Module):
    """A user's wrapper that takes dict batches (``input_ids`` + ``attention_mask``)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, batch):
        return self.lm(**batch)


class Logits(torch.nn.Module):
    """A user's wrapper returning the logits tensor (what ``predict`` gathers), for token tensors or dicts."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, batch):
        return (self.lm(**batch) if isinstance(batch, dict) else self.lm(batch)).logits


def logits_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def data(seq: int = SEQ, rows: int = GLOBAL_BATCH * STEPS, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (rows, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def padded_data(*, left: bool, seq: int = SEQ):
    """Rows with 0-12 padding tokens, at the end (``left=False``) or, on odd rows, at the start; padded
    targets are -100. Returns ``({"input_ids", "attention_mask"}, targets)``."""
    x, y = data(seq)
    mask = torch.ones_like(x)
    y = y.clone()
    for row in range(len(x)):
        pad = (row * 5) % 13
        if pad == 0:
            continue
        cols = slice(0, pad) if left and row % 2 else slice(seq - pad, seq)
        mask[row, cols] = 0
        x[row, cols] = 2
        y[row, cols] = -100
    return {"input_ids": x, "attention_mask": mask}, y


def packed_data(seq: int = SEQ):
    """Rows of packed sequences: ``position_ids`` restart at 1 to 3 document starts per row. Returns
    ``({"input_ids", "position_ids"}, targets)``."""
    x, y = data(seq)
    positions = torch.arange(seq).repeat(len(x), 1)
    for row in range(len(x)):
        for start in sorted({(row * 7) % 11 + 3, (row * 5) % 13 + 17}):
            positions[row, start:] = torch.arange(seq - start)
    return {"input_ids": x, "position_ids": positions}, y


def lm_loss(outputs, targets):
    logits = outputs.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_optimizer(params):
    # Adam moves a weight by ~lr whatever its gradient's size, so summation-order noise in a gradient reaches
    # the weights scaled up: on one process, eager vs sdpa attention (both exact) differ by 1.6e-6 after 3
    # steps at lr 1e-2 and by 1.2e-7 at lr 1e-3. lr 1e-3 and eps 1e-5 keep a 1e-6 tolerance about the layout.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, eps=1e-5)


def reference(model: torch.nn.Module, inputs, targets, *, steps: int = STEPS, batch: int = GLOBAL_BATCH):
    """``steps`` AdamW steps of a plain one-process loop; returns (state, losses)."""
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        x = {k: v[rows] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[rows]
        opt.zero_grad()
        loss = lm_loss(model(x), targets[rows])
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def check_ranks(result: list, name: str, expected, tolerance: float = 1e-6, grad_tolerance: float | None = None):
    """A ``tm.Trainer`` run's per-process records (``result[rank][name]``: ``loss``, ``grads``, ``state``, names
    behind ``Padded``'s ``lm.`` allowed) against one process's ``(state, loss, grads)``: every process's
    loss, its parameters' recorded gradients and (main process) every parameter; together the processes
    hold a gradient of every parameter."""
    state, loss, expected_grads = expected
    grad_tolerance = tolerance if grad_tolerance is None else grad_tolerance
    got = result[0][name]
    assert abs(got["loss"] - loss) <= tolerance, (name, got["loss"], loss)
    strip = lambda d: {k.removeprefix("lm."): v for k, v in d.items()}  # noqa: E731 - Padded's prefix
    diff = max_diff(strip(got["state"]), state)
    assert diff <= tolerance, f"{name}: parameters differ by {diff:.3g}"
    held = set()
    for rank, rank_result in enumerate(result):
        mine = rank_result[name]
        assert mine["loss"] == got["loss"], (name, rank)  # every process reports the global loss
        assert mine["grads"], f"{name}: rank {rank} holds no gradients"
        for key, grad in strip(mine["grads"]).items():
            gdiff = (grad - expected_grads[key]).abs().max().item()
            assert gdiff <= grad_tolerance, f"{name}: rank {rank} gradient of {key} differs by {gdiff:.3g}"
        held |= strip(mine["grads"]).keys()
    assert held == expected_grads.keys(), (name, expected_grads.keys() - held)
    worst = max((g - expected_grads[k]).abs().max().item() for r in result for k, g in strip(r[name]["grads"]).items())
    print(f"{name}: loss {abs(got['loss'] - loss):.2g}, parameters {diff:.2g}, gradients {worst:.2g} from one process")
