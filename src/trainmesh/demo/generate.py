"""Sampling text from a trained :class:`~trainmesh.demo.char_gpt.CharGPT`.

Sampling draws from a private ``torch.Generator``, so a given model, prompt and seed give
the same text every time and the global RNG (which the training loop owns) is untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from .corpus import CharVocab


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP (and similar wrappers) keep the real model in `.module`; sampling must not run the
    # wrapper's forward, which would join gradient-synchronisation bookkeeping on one rank only.
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


@torch.no_grad()
def sample_ids(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 20,
    seed: int = 0,
) -> torch.Tensor:
    """``prompt_ids`` (1-D) followed by ``max_new_tokens`` sampled ids.

    ``temperature`` divides the logits (lower is more conservative; 0 means greedy);
    ``top_k`` keeps only the k most likely characters before sampling.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0. Received: {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None. Received: {top_k}")
    if prompt_ids.ndim != 1 or len(prompt_ids) == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D tensor. Received shape {tuple(prompt_ids.shape)}")
    model = _unwrap(model)
    block_size = model.config.block_size
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        ids = prompt_ids.to(device=device, dtype=torch.long).unsqueeze(0)
        for _ in range(max_new_tokens):
            # The model only knows block_size positions: condition on the most recent ones.
            logits = model(ids[:, -block_size:])[0, -1].float()
            if temperature == 0:
                next_id = logits.argmax().view(1)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    finally:
        model.train(was_training)
    return ids[0].cpu()


def generate(
    model: nn.Module,
    vocab: CharVocab,
    prompt: str = "def ",
    max_new_tokens: int = 200,
    *,
    temperature: float = 0.8,
    top_k: int | None = 20,
    seed: int = 0,
) -> str:
    """``prompt`` and its continuation, as text."""
    ids = sample_ids(model, vocab.encode(prompt), max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return vocab.decode(ids)
