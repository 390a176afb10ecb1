"""What ``--model`` names: a built-in preset, a transformers ``config.json``, or ``module:function``.

Presets are transformers configs (built from the config, never downloaded): ``llama-7b`` and
``llama-70b`` (the Llama 2 shapes: 32 x 4096, 80 x 8192 with 8 KV heads), ``llama-13b``, ``gpt2-xl``
(48 x 1600), and ``tiny-llama`` (4 small layers, for tests). Every factory runs under
``torch.device("meta")`` in the planner, so a 70B model costs nothing to build.

>>> sorted(PRESETS)
['gpt2-xl', 'llama-13b', 'llama-70b', 'llama-7b', 'tiny-llama']
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from typing import Callable

PRESETS: dict[str, dict] = {
    "llama-7b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama-13b": dict(
        model_type="llama",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama-70b": dict(
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "gpt2-xl": dict(model_type="gpt2", n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024),
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=1024,
        max_position_embeddings=512,
    ),
}


def _from_config(config: dict):
    import transformers

    config = dict(config)
    kind = config.pop("model_type", None)
    if kind is None:
        raise ValueError(f"A transformers config needs a model_type. Received keys: {sorted(config)[:8]}")
    cfg = transformers.AutoConfig.for_model(kind, **config)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def model_factory(spec: str | Callable) -> Callable:
    """A zero-argument factory for ``spec`` (a preset name, a config.json path, ``module:function``)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"--model is a preset ({', '.join(sorted(PRESETS))}), a config.json path or "
            f"module:function. Received: model={spec!r}"
        )
    if spec in PRESETS:
        return functools.partial(_from_config, PRESETS[spec])
    if spec.endswith(".json") or os.path.isfile(spec):
        try:
            with open(spec) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"Cannot read a transformers config from {spec!r}: {exc}") from exc
        return functools.partial(_from_config, config)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"--model is a preset ({', '.join(sorted(PRESETS))}), a config.json path or "
            f"module:function. Received: model={spec!r}"
        )
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"Cannot import {spec!r}: {exc}") from exc
    if not callable(target):
        raise ValueError(f"{spec} is not callable. Received: {type(target).__name__}")
    return target


def model_shape(model) -> dict:
    """Layers, hidden size and parameter count (for the MFU convention), from a transformers config when present."""
    config = getattr(model, "config", None)
    get = lambda *names: next((getattr(config, n) for n in names if getattr(config, n, None)), None)  # noqa: E731
    return {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_layers": get("num_hidden_layers", "n_layer") if config is not None else None,
        "hidden": get("hidden_size", "n_embd") if config is not None else None,
    }
