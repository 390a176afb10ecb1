"""A small GPT-style character model: embeddings, pre-LN causal transformer blocks, a tied head.

Kept deliberately plain (``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding`` and
``scaled_dot_product_attention``) so that DDP, autocast and any layout map apply to it
without special cases. Every parameter takes part in every forward pass, which DDP needs
when ``find_unused_parameters`` is off.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# Up to this sequence length, a low-precision attention on CPU takes torch's math kernel (two
# matmuls and a softmax) instead of its CPU flash kernel: at the demo's shapes the flash kernel's
# bf16 backward is 3x slower (one thread, forward + backward, batch 16, 4 heads of 32: T=64 2.7 vs
# 7.7 ms, T=128 10.3 vs 17.5 ms; at T=256 with heads of 64 flash is ahead, 20 vs 24 ms). It was over
# half of the demo's step, and an opaque kernel that torch.compile cannot fuse or speed up either;
# the math path's mask, softmax and casts are ordinary ops that inductor fuses.
MATH_ATTENTION_MAX_T = 128


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes. The demo's defaults train meaningfully in about two minutes on 4 CPU processes."""

    vocab_size: int
    block_size: int = 64
    n_layer: int = 3
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_weights: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model must be divisible by n_head. Received: d_model={self.d_model}, n_head={self.n_head}"
            )
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1. Received: {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (B, T, 3C) -> three (B, heads, T, C/heads) tensors.
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        if x.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and t <= MATH_ATTENTION_MAX_T:
            with sdpa_kernel(SDPBackend.MATH):  # scoped to this call: torch's choice is restored after it
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LN: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``, which trains stably without warm-up tricks."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, hidden), nn.GELU(), nn.Linear(hidden, config.d_model), nn.Dropout(config.dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """``ids (B, T) -> logits (B, T, vocab_size)`` with ``T <= block_size``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            # One matrix for "which vector is this character" in and out: fewer parameters
            # and, at this size, a lower loss for the same steps.
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps the residual stream's
        # variance from growing with depth.
        for name, param in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[-1]
        if t > self.config.block_size:
            raise ValueError(f"Sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=ids.device)
        x = self.drop(self.tok_emb(ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy over every position (nats per character).

    ``outputs`` are ``(B, T, V)`` logits, ``targets`` ``(B, T)`` ids. The logits are cast to
    float32 first: under bf16 autocast they arrive in bf16, whose 8-bit mantissa would make
    the log-softmax over the vocabulary visibly coarse.
    """
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(), targets.reshape(-1))
