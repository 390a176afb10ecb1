"""Tiny transformers configs that tests build models from (no download): one definition each, so the
tests that compare counts or layouts across files build the same model.

transformers is imported when a config is asked for, so this package does not need it.

>>> config = tiny_qwen3_moe_config(num_experts=4)
>>> config.num_experts, config.hidden_size, config.num_hidden_layers
(4, 16, 2)
"""

from __future__ import annotations

from typing import Any


def tiny_qwen3_moe_config(num_experts: int = 8) -> Any:
    """A Qwen3-MoE of 2 layers, both MoE (``decoder_sparse_step=1``, no dense-only layer), hidden 16,
    experts of width 8, 2 experts a token, vocabulary 32, 2 heads of 8: a ``transformers.Qwen3MoeConfig``."""
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=num_experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
