"""What context parallelism checks of a model before its first step: where its transformers model is,
which attention features it uses (refused by name: sliding windows, attention sinks, attention
dropout), and which method ``context_parallel="auto"`` resolves to."""

from __future__ import annotations

from torch import nn


def transformers_model(model: nn.Module) -> nn.Module | None:
    """The outermost transformers model inside ``model`` (a user's wrapper around one is fine)."""
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module, "set_attn_implementation"):
            return module
    return None


def resolve_method(method: str, heads: int, kv_heads: int, size: int) -> str:
    """``auto``: Ulysses where the query heads divide over the axis (4 all-to-alls of 1/n of Q, K, V, O
    per layer, one kernel call over the whole sequence), else ring (K/V of the whole sequence gathered
    per layer, any head count)."""
    if method == "auto":
        return "ulysses" if heads % size == 0 else "ring"
    if method == "ulysses" and heads % size:
        raise ValueError(
            f"Ulysses splits the attention heads over the sequence axis: {heads} heads do not divide "
            f"over {size} processes. Use context_parallel='ring', or an axis size that divides the "
            f"heads. Received: num_attention_heads={heads}, axis size {size}"
        )
    return method


def check_config(config) -> tuple[int, int]:
    """``(heads, kv_heads)``; unsupported attention features refused by name."""
    for name in ("sliding_window", "attention_chunk_size"):
        if getattr(config, name, None) and getattr(config, "use_sliding_window", True):
            raise ValueError(
                f"Context parallelism supports full causal attention only; this model uses a "
                f"sliding window. Received: {name}={getattr(config, name)}"
            )
    if getattr(config, "layer_types", None) and any(t != "full_attention" for t in config.layer_types):
        raise ValueError(
            f"Context parallelism supports full causal attention only. Received: "
            f"layer_types={sorted(set(config.layer_types))}"
        )
    if any("sink" in name for name in vars(config)):
        raise ValueError(
            "Context parallelism does not support attention sinks. Received: a config with "
            f"{[n for n in vars(config) if 'sink' in n]}"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(
            f"Context parallelism does not support attention dropout. Received: "
            f"attention_dropout={config.attention_dropout}"
        )
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"Context parallelism needs num_attention_heads in the model's config. Received: {config!r}")
    return heads, getattr(config, "num_key_value_heads", None) or heads
