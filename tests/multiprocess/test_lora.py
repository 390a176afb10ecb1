"""Fine-tuning with peft LoRA under trainmesh layouts, on 2 gloo processes, against one process.

One launch trains a peft LoRA Llama (and GPT-2 under the layouts whose code differs for its
Conv1D) with ``tm.Trainer`` under DataParallel, ZeRO 1 and 3 and ModelParallel with
``LayoutMap.auto`` on a (1, 2) mesh, and checks in each:

* parity: every tensor after 3 AdamW steps equals a plain one-process peft loop (fp32, 1e-5);
  the frozen base equals its start exactly;
* frozen parameters cost nothing: their gradients stay None, the optimizer holds state for
  trainable parameters only, and with fp16 compression installed (DDP and ZeRO-3) the gradient
  bytes counted at the communication layer are the adapters' only;
* tensor parallelism really happens: base weights and adapters are sharded as ``adapters.py`` says;
* ``tm.save_pretrained`` writes peft's adapter format, which ``PeftModel.from_pretrained`` loads
  (in the test process) with the trained adapter values; ``merge_adapters=True`` writes a full
  model transformers loads, equal to peft's own ``merge_and_unload``.
"""

from __future__ import annotations

import os

import pytest
import torch

from trainmesh.testing import run_distributed

from lora_cases import (
    GLOBAL_BATCH,
    base_model,
    data,
    lm_loss,
    lora_config,
    lora_model,
    make_optimizer,
    make_sgd,
    reference,
    train_reference,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# (family, layout, zero stage, compression)
CONFIGS = [
    ("llama", "dp", 0, None),
    ("llama", "dp", 1, None),
    ("llama", "dp", 3, None),
    ("llama", "tp", 0, None),
    ("gpt2", "tp", 0, None),
    ("gpt2", "dp", 3, None),
    ("llama", "dp", 0, "fp16"),
    ("llama", "dp", 3, "fp16"),
]


def _name(config) -> str:
    return "-".join(str(part) for part in config)


def _run_all(root: str, configs=None, save: bool = True) -> dict:
    import trainmesh as tm
    from torch.distributed.tensor import DTensor

    out = {}
    for config in configs or CONFIGS:
        family, layout, stage, compression = config
        model = lora_model(family)
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        distribution = None
        if layout == "tp":
            mesh = tm.DeviceMesh((1, 2), ["data", "model"], devices=tm.list_devices())
            distribution = tm.ModelParallel(
                layout_map=tm.LayoutMap.auto(model, mesh, verbose=False), batch_dim_name="data"
            )
        trainer = tm.Trainer(
            model,
            make_optimizer,
            lm_loss,
            distribution=distribution,
            zero_stage=stage,
            compression=compression,
            progress=False,
        )
        history = trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
        module = trainer.unwrapped_model if hasattr(trainer, "unwrapped_model") else trainer.model
        params = dict(trainer.model.named_parameters())
        result = {
            "frozen_grads": [n for n, p in params.items() if not p.requires_grad and p.grad is not None],
            "state_for_frozen": [n for n, p in params.items() if not p.requires_grad and p in trainer.optimizer.state],
            "frozen_in_optimizer": [
                n
                for n, p in params.items()
                if not p.requires_grad and any(p is q for g in trainer.optimizer.param_groups for q in g["params"])
            ],
            "state_count": len(trainer.optimizer.state),
            "trainable_count": sum(p.requires_grad for p in params.values()),
            "trainable_bytes": sum(p.numel() * 4 for p in module.parameters() if p.requires_grad),
            "frozen_bytes": sum(p.numel() * 4 for p in module.parameters() if not p.requires_grad),
            "comm_uncompressed": [r.get("comm_bytes_uncompressed") for r in history.steps] if compression else None,
            "placements": {
                n: [str(pl) for pl in p.placements]
                for n, p in params.items()
                if isinstance(p, DTensor) and layout == "tp"
            },
        }
        state = trainer.state_dict()["model"]
        result["state"] = {k: v.detach().clone() for k, v in state.items()}
        result["start"] = start if tm.runtime.rank() == 0 else None
        if save and not compression:
            tm.save_pretrained(trainer.model, os.path.join(root, _name(config)))
            tm.save_pretrained(trainer.model, os.path.join(root, _name(config) + "-merged"), merge_adapters=True)
        out[config] = result
    if configs is None:
        out["meta"] = _meta_runs(os.path.join(root, "base"))
    return out


META_LAYOUTS = [("dp", 3), ("tp", 0)]


def _meta_runs(base_dir: str) -> dict:
    """A meta-built Llama under LoRA, its base read from a Hugging Face directory (``weights=``)."""
    import transformers
    import trainmesh as tm

    out = {}
    for layout, stage in META_LAYOUTS:
        with torch.device("meta"):
            model = peft.get_peft_model(
                transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base_dir)),
                lora_config("llama", init=True),
            )
        distribution = None
        if layout == "tp":
            mesh = tm.DeviceMesh((1, 2), ["data", "model"], devices=tm.list_devices())
            distribution = tm.ModelParallel(
                layout_map=tm.LayoutMap.auto(model, mesh, verbose=False), batch_dim_name="data"
            )
        trainer = tm.Trainer(
            model, make_sgd, lm_loss, distribution=distribution, zero_stage=stage, weights=base_dir, progress=False
        )
        initial = {k: v.detach().clone() for k, v in trainer.state_dict()["model"].items()}
        trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
        out[layout] = (initial, {k: v.detach().clone() for k, v in trainer.state_dict()["model"].items()})
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora"))
    base_model("llama", seed=5).save_pretrained(os.path.join(root, "base"))  # the checkpoint meta builds read
    got = run_distributed(_run_all, world_size=2, args=(root,), timeout=380)
    return root, got, {family: reference(family) for family in ("llama", "gpt2")}


def test_lora_parity_every_layout(results):
    _, got, references = results
    for config in CONFIGS:
        if config[3]:
            continue  # compressed gradients are not the reference's
        state, expected, start = got[0][config]["state"], references[config[0]], got[0][config]["start"]
        assert state.keys() == expected.keys(), config
        moved = 0.0
        for name, value in expected.items():
            diff = (state[name] - value).abs().max().item()
            assert diff <= 1e-5, f"{config}: {name} differs from one process by {diff:.3g}"
            if "lora_" not in name:
                assert torch.equal(state[name], start[name]), f"{config}: frozen {name} changed"
            else:
                moved = max(moved, (value - start[name]).abs().max().item())
        assert moved > 1e-3, config  # the adapters trained: a run that did nothing could not pass


def test_frozen_parameters_cost_nothing(results):
    _, got, _ = results
    for config in CONFIGS:
        for rank_result in got:
            r = rank_result[config]
            assert r["frozen_grads"] == [], config
            assert r["state_for_frozen"] == [], config
            assert r["frozen_in_optimizer"] == [], config  # ZeRO-1 would partition and broadcast them
            if config[2] != 1:  # ZeRO-1: each process holds its partition's state only
                assert r["state_count"] == r["trainable_count"], config
            if config[3]:  # bytes handed to the gradient collectives, counted by the communication layer
                for sent in r["comm_uncompressed"]:
                    assert r["trainable_bytes"] <= sent < r["trainable_bytes"] + 4096, (
                        config,
                        sent,
                        r["trainable_bytes"],
                    )
                    assert sent < r["frozen_bytes"] / 5, config


def test_tensor_parallel_shards_base_and_adapters(results):
    _, got, _ = results
    llama = got[0][("llama", "tp", 0, None)]["placements"]
    prefix = "base_model.model.model.layers.0."
    assert llama[prefix + "self_attn.q_proj.base_layer.weight"] == ["S(0)"]
    assert llama[prefix + "self_attn.q_proj.lora_B.default.weight"] == ["S(0)"]
    assert llama[prefix + "self_attn.o_proj.base_layer.weight"] == ["S(1)"]
    assert llama[prefix + "self_attn.o_proj.lora_A.default.weight"] == ["S(1)"]
    assert llama[prefix + "mlp.down_proj.lora_A.default.weight"] == ["S(1)"]
    assert prefix + "self_attn.q_proj.lora_A.default.weight" not in llama  # small factor: whole, plain
    gpt2 = got[0][("gpt2", "tp", 0, None)]["placements"]
    assert gpt2["base_model.model.transformer.h.0.mlp.c_fc.base_layer.weight"] == ["S(1)"]  # Conv1D in x out
    assert gpt2["base_model.model.transformer.h.0.mlp.c_fc.lora_B.default.weight"] == ["S(0)"]


def test_adapters_saved_in_peft_format(results):
    root, got, references = results
    for config in CONFIGS:
        if config[3]:
            continue
        family, directory = config[0], os.path.join(root, _name(config))
        assert sorted(os.listdir(directory)) == ["adapter_config.json", "adapter_model.safetensors"], config
        loaded = peft.PeftModel.from_pretrained(base_model(family), directory)
        trained = got[0][config]["state"]
        adapters = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
        assert adapters, config
        for name, value in adapters.items():
            assert torch.equal(value, trained[name]), f"{config}: {name}"
        merged = transformers.AutoModelForCausalLM.from_pretrained(directory + "-merged")
        expected = loaded.merge_and_unload().state_dict()
        for name, value in merged.state_dict().items():
            assert (value - expected[name]).abs().max().item() <= 1e-6, f"{config}: merged {name}"


def test_meta_built_base_with_weights_under_lora(results):
    """Base tensors equal the file exactly, adapters get peft's initialisation (B zero, A the same on every
    layout), and 3 steps equal one process training the same adapters over ``from_pretrained``'s base."""
    root, got, _ = results
    base_dir = os.path.join(root, "base")
    file_state = transformers.AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    runs = got[0]["meta"]
    first_initial = runs[META_LAYOUTS[0][0]][0]
    for layout, (initial, final) in runs.items():
        for name, value in initial.items():
            if "lora_B" in name:
                assert torch.count_nonzero(value) == 0, (layout, name)
            elif "lora_A" in name:
                assert torch.isfinite(value).all() and value.abs().max() > 0, (layout, name)
                assert torch.equal(value, first_initial[name]), (layout, name)  # layout-independent
            else:
                expected = file_state[name.removeprefix("base_model.model.").replace(".base_layer.", ".")]
                assert torch.equal(value, expected), (layout, name)
        model = peft.get_peft_model(
            transformers.AutoModelForCausalLM.from_pretrained(base_dir), lora_config("llama", init=True)
        )
        model.load_state_dict(initial)
        expected = train_reference(model, make_sgd)
        for name, value in expected.items():
            diff = (final[name] - value).abs().max().item()
            assert diff <= 1e-5, f"meta {layout}: {name} differs from one process by {diff:.3g}"
