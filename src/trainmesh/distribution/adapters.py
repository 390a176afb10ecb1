"""peft's LoRA layers as the rest of trainmesh sees them: read by duck typing, peft never imported.

``peft.get_peft_model`` replaces each target module (a Linear, transformers' Conv1D) by a LoRA
layer that holds the original as ``base_layer`` beside the adapters ``lora_A[name]`` (in -> r)
and ``lora_B[name]`` (r -> out), and moves the whole model under ``base_model.model.``. So:

* a tensor-parallel plan written for the base model (transformers' ``base_model_tp_plan``, the
  derived Megatron plan) names the LoRA layer; it applies to ``base_layer``, and the adapters
  follow it (``adapter_layouts``): a column-parallel base splits ``lora_B`` by output (its output
  is then as sharded as the base's), a row-parallel base splits ``lora_A`` by input (it reads the
  same sharded input as the base); the other adapter factor is small and stays whole;
* the names of a Hugging Face checkpoint of the base are the model's names without the peft
  prefix and without ``.base_layer`` (``base_checkpoint_name``); adapter tensors are in no such
  file and get peft's own initialisation (``lora_inits``).
"""

from __future__ import annotations

from torch import nn

PEFT_PREFIX = "base_model.model."


def is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA layer (``peft.tuners.lora.LoraLayer``): a ``base_layer`` and adapter dicts."""
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
    )


def base_of(module: nn.Module) -> nn.Module:
    """The layer a LoRA layer wraps (itself for any other module)."""
    while is_lora_layer(module):
        module = module.base_layer
    return module


def linear_kind(module: nn.Module) -> str | None:
    """ "linear" or "conv1d" for the layers LoRA adapts (and tensor parallelism splits), else None."""
    module = base_of(module)  # a peft LoRA layer is the layer it wraps
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return "conv1d"  # transformers' GPT-2 layer: weight stored (in, out)
    return None


def adapter_names(module: nn.Module) -> list[str]:
    return list(module.lora_A.keys()) if is_lora_layer(module) else []


def adapter_layouts(path: str, module: nn.Module, style: str, axis: str) -> dict[str, tuple]:
    """The adapters' layouts beside a base laid out ``style`` ("colwise" / "rowwise") over ``axis``.
    ``lora_A`` / ``lora_B`` are ``nn.Linear`` (weight out x in) whatever the base's kind."""
    layouts: dict[str, tuple] = {}
    for name in adapter_names(module):
        if style == "colwise":
            layouts[f"{path}.lora_B.{name}.weight"] = (axis, None)
            if getattr(module.lora_B[name], "bias", None) is not None:
                layouts[f"{path}.lora_B.{name}.bias"] = (axis,)
        else:
            layouts[f"{path}.lora_A.{name}.weight"] = (None, axis)
    return layouts


def layer_path(model: nn.Module, path: str) -> str:
    """The LoRA layer a sub-module path belongs to (``x.q_proj.base_layer`` / ``x.q_proj.lora_B.default``
    -> ``x.q_proj``); other paths unchanged. Tensor-parallel siblings are found by this path."""
    parts = path.split(".")
    for cut, tail in ((1, ("base_layer",)), (2, ("lora_A", "lora_B"))):
        if len(parts) > cut and parts[-cut] in tail:
            owner = ".".join(parts[:-cut])
            if is_lora_layer(model.get_submodule(owner)):
                return owner
    return path


def is_peft_model(model: nn.Module) -> bool:
    return isinstance(getattr(model, "peft_config", None), dict) and any(is_lora_layer(m) for m in model.modules())


def adapter_tensor_names(model: nn.Module) -> set[str]:
    """Every adapter tensor of ``model`` (LoRA A/B and peft's other per-adapter tensors), by full name."""
    names: set[str] = set()
    for path, module in model.named_modules():
        if not is_lora_layer(module):
            continue
        for attr in getattr(module, "adapter_layer_names", ("lora_A", "lora_B")):
            sub = getattr(module, attr, None)
            if isinstance(sub, nn.Module):
                names.update(f"{path}.{attr}.{n}" for n, _ in sub.named_parameters())
    return names


def base_checkpoint_name(name: str) -> str:
    """A peft model's tensor name as a Hugging Face checkpoint of its base model spells it."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def lora_inits(model: nn.Module) -> dict[str, dict[str, object]]:
    """LoRA layer path -> {adapter name: its ``init_lora_weights``} from the peft config(s)."""
    configs: dict = {}
    for module in model.modules():
        if isinstance(getattr(module, "peft_config", None), dict):
            configs.update(module.peft_config)
    return {
        path: {name: getattr(configs.get(name), "init_lora_weights", True) for name in adapter_names(module)}
        for path, module in model.named_modules()
        if is_lora_layer(module)
    }


def check_lora_targets(model: nn.Module) -> None:
    """Raise ValueError naming every LoRA target module that matched nothing in ``model``.

    peft refuses a config none of whose targets exist, but accepts one where only some do: a
    misspelt ``"v_projj"`` beside ``"q_proj"`` silently trains fewer adapters than asked. Targets
    given as a list are suffixes of module paths (peft's own rule); a regex string or
    ``"all-linear"`` is left to peft.
    """
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not is_peft_model(model):
        return
    lora_paths = [path for path, module in model.named_modules() if is_lora_layer(module)]
    for adapter, config in configs.items():
        targets = getattr(config, "target_modules", None)
        if not isinstance(targets, (list, set, tuple, frozenset)):
            continue
        missing = sorted(t for t in targets if not any(path == t or path.endswith("." + t) for path in lora_paths))
        if missing:
            leaves = sorted({path.rsplit(".", 1)[-1] for path, m in model.named_modules() if linear_kind(m)})
            raise ValueError(
                f"LoRA adapter {adapter!r}: target module(s) {missing} are not in the model, so no "
                f"adapter was made for them. Linear layers it has: {leaves}. "
                f"Received: target_modules={sorted(targets)}"
            )
