"""peft LoRA models under a pipe axis, on 4 gloo processes, against one process (issue 37, the pipeline).

One launch trains a peft LoRA Llama and GPT-2 (``lora_cases``; a 4-layer Llama where a schedule
needs 4 stages) with ``tm.Trainer`` on pipe 2 x data 2 (GPipe, 1F1B, ZBV, 1F1B under ZeRO-3) and
pipe 2 x model 2 with ``LayoutMap.auto`` (1F1B, GPipe), and checks in each:

* parity: the stages together hold every parameter, equal to a plain one-process peft loop
  after 3 AdamW steps (fp32, 1e-5); the frozen base equals its start exactly;
* frozen parameters cost nothing: no gradient, no optimizer state, not in the optimizer; on
  pipe 2 x data 2 without ZeRO the elements all-reduced per step are the local adapters' (plus
  the loss), never a frozen weight's. GPT-2 is the regression: its frozen tied ``wte`` /
  ``lm_head`` pair got a zero gradient summed across the stages every step, and under a model
  axis the two sides' shapes differed and gloo aborted the job;
* tensor parallelism happens inside the stages: base weights and adapters sharded as ``adapters.py`` says;
* split points written as for the base model (``model.layers.1``) split the peft model there;
* ``tm.save_pretrained`` from the pipeline writes peft's adapter format holding every stage's
  adapters, which ``PeftModel.from_pretrained`` loads with the trained values, and
  ``merge_adapters=True`` writes a full model equal to peft's own ``merge_and_unload``.
"""

from __future__ import annotations

import os

import pytest
import torch

from trainmesh.testing import run_distributed

from lora_cases import GLOBAL_BATCH, STEPS, base_model, data, lm_loss, lora_model, make_optimizer, train_reference

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

P2D2 = ((2, 2), ("pipe", "data"))
P2M2 = ((2, 1, 2), ("pipe", "data", "model"))
# (family, layers, mesh, schedule, zero stage, split points, save)
CONFIGS = [
    ("llama", 2, P2D2, "1f1b", 0, None, True),
    ("llama", 2, P2D2, "gpipe", 0, None, False),
    ("gpt2", 2, P2D2, "1f1b", 0, None, True),
    ("llama", 2, P2D2, "1f1b", 3, None, True),
    ("llama", 2, P2M2, "1f1b", 0, None, True),
    ("gpt2", 2, P2M2, "gpipe", 0, None, True),
    ("llama", 4, P2D2, "zbv", 0, None, False),
    ("llama", 4, P2D2, "1f1b", 0, ("model.layers.1",), False),
]


def _name(config) -> str:
    family, layers, (shape, _), schedule, stage, points, _ = config
    return f"{family}{layers}-{'x'.join(map(str, shape))}-{schedule}-z{stage}" + ("-split" if points else "")


def _counting_all_reduces(sizes: list):
    original = torch.distributed.all_reduce

    def counted(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    return original, counted


def _run_all(root: str) -> dict:
    import trainmesh as tm
    from torch.distributed.tensor import DTensor

    out = {}
    for config in CONFIGS:
        family, layers, (shape, axes), schedule, stage, points, save = config
        mesh = tm.DeviceMesh(shape, list(axes), devices=tm.list_devices())
        model = lora_model(family, layers=layers)
        pipeline = tm.Pipeline(axis="pipe", schedule=schedule, microbatches=2, split_points=points or "auto")
        if "model" in axes:
            distribution = tm.ModelParallel(
                layout_map=tm.LayoutMap.auto(model, mesh, model_axis="model", verbose=False),
                batch_dim_name="data",
                pipeline=pipeline,
            )
        else:
            distribution = tm.DataParallel(device_mesh=mesh, pipeline=pipeline)
        trainer = tm.Trainer(
            model, make_optimizer, lm_loss, distribution=distribution, zero_stage=stage, progress=False
        )
        sizes: list[int] = []
        original, counted = _counting_all_reduces(sizes)
        torch.distributed.all_reduce = counted
        try:
            trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
        finally:
            torch.distributed.all_reduce = original
        params = dict(trainer.model.named_parameters())
        in_optimizer = {id(q) for g in trainer.optimizer.param_groups for q in g["params"]}
        out[config] = {
            "params": {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()
            },
            "frozen_grads": [n for n, p in params.items() if not p.requires_grad and p.grad is not None],
            "state_for_frozen": [n for n, p in params.items() if not p.requires_grad and p in trainer.optimizer.state],
            "frozen_in_optimizer": [n for n, p in params.items() if not p.requires_grad and id(p) in in_optimizer],
            "state_count": len(trainer.optimizer.state),
            "trainable_count": sum(p.requires_grad for p in params.values()),
            "trainable_local": sum(p.numel() for p in params.values() if p.requires_grad),
            "frozen_smallest": min(p.numel() for p in params.values() if not p.requires_grad),
            "all_reduced_per_step": sum(sizes) / STEPS,
            "placements": {n: [str(pl) for pl in p.placements] for n, p in params.items() if isinstance(p, DTensor)},
        }
        if save:
            tm.save_pretrained(trainer.model, os.path.join(root, _name(config)))
            tm.save_pretrained(trainer.model, os.path.join(root, _name(config) + "-merged"), merge_adapters=True)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora_pipeline"))
    got = run_distributed(_run_all, world_size=4, args=(root,), timeout=280)
    references, starts = {}, {}
    for family, layers in {(c[0], c[1]) for c in CONFIGS}:
        model = lora_model(family, layers=layers)
        starts[family, layers] = {k: v.detach().clone() for k, v in model.named_parameters()}
        references[family, layers] = train_reference(model)
    return root, got, references, starts


def _merged(got: list, config) -> dict:
    merged: dict = {}
    for rank_result in got:
        for name, value in rank_result[config]["params"].items():
            if name in merged:
                assert torch.equal(merged[name], value), f"{config}: two processes disagree on {name}"
            merged[name] = value
    return merged


def test_lora_pipeline_parity(results):
    _, got, references, starts = results
    for config in CONFIGS:
        expected, start = references[config[:2]], starts[config[:2]]
        state = _merged(got, config)
        # every parameter of the model (a tied GPT-2 head: under its own name on the last stage too)
        assert set(start) <= set(state) <= set(expected), config
        moved = 0.0
        for name, value in state.items():
            diff = (value - expected[name]).abs().max().item()
            assert diff <= 1e-5, f"{config}: {name} differs from one process by {diff:.3g}"
            key = name if name in start else "base_model.model.transformer.wte.weight"  # tied head
            if "lora_" not in name:
                assert torch.equal(value, start[key]), f"{config}: frozen {name} changed"
            else:
                moved = max(moved, (value - start[name]).abs().max().item())
        assert moved > 1e-3, config  # the adapters trained: a run that did nothing could not pass


def test_frozen_parameters_cost_nothing_in_a_pipeline(results):
    _, got, _, _ = results
    for config in CONFIGS:
        for rank_result in got:
            r = rank_result[config]
            assert r["frozen_grads"] == [], config
            assert r["state_for_frozen"] == [], config
            assert r["frozen_in_optimizer"] == [], config
            assert r["state_count"] == r["trainable_count"] > 0, config
            if config[2] == P2D2 and config[4] == 0:
                # one flattened all-reduce of the adapters' gradients over the data axis, plus the loss;
                # the slack is smaller than any frozen tensor, so none of them can hide in it
                assert r["trainable_local"] <= r["all_reduced_per_step"] <= r["trainable_local"] + 16, (config, r)
                assert r["frozen_smallest"] > 16, config


def test_tensor_parallel_inside_the_stages(results):
    _, got, _, _ = results
    llama = {n: p for rank_result in got for n, p in rank_result[CONFIGS[4]]["placements"].items()}
    prefix = "base_model.model.model.layers.0."
    assert llama[prefix + "self_attn.q_proj.base_layer.weight"] == ["S(0)"]
    assert llama[prefix + "self_attn.q_proj.lora_B.default.weight"] == ["S(0)"]
    assert llama[prefix + "mlp.down_proj.base_layer.weight"] == ["S(1)"]
    assert llama[prefix + "mlp.down_proj.lora_A.default.weight"] == ["S(1)"]
    assert "base_model.model.model.layers.1.self_attn.o_proj.lora_A.default.weight" in llama  # the second stage's
    gpt2 = {n: p for rank_result in got for n, p in rank_result[CONFIGS[5]]["placements"].items()}
    assert gpt2["base_model.model.transformer.h.1.mlp.c_fc.lora_B.default.weight"] == ["S(0)"]


def test_split_points_named_as_in_the_base_model(results):
    _, got, _, _ = results
    held = [{n.split(".layers.")[1].split(".")[0] for n in r[CONFIGS[7]]["params"] if ".layers." in n} for r in got]
    assert held == [{"0"}, {"0"}, {"1", "2", "3"}, {"1", "2", "3"}]  # pipe rank 0: ranks 0-1


def test_adapters_saved_from_a_pipeline_in_peft_format(results):
    root, got, _, _ = results
    for config in [c for c in CONFIGS if c[-1]]:
        family, layers = config[:2]
        directory = os.path.join(root, _name(config))
        assert sorted(os.listdir(directory)) == ["adapter_config.json", "adapter_model.safetensors"], config
        loaded = peft.PeftModel.from_pretrained(base_model(family, layers=layers), directory)
        trained = _merged(got, config)
        adapters = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
        assert len(adapters) == sum("lora_" in k for k in trained), config  # both stages' adapters
        for name, value in adapters.items():
            assert torch.equal(value, trained[name]), f"{config}: {name}"
        merged = transformers.AutoModelForCausalLM.from_pretrained(directory + "-merged")
        expected = loaded.merge_and_unload().state_dict()
        assert merged.state_dict().keys() == expected.keys(), config
        for name, value in merged.state_dict().items():
            assert (value - expected[name]).abs().max().item() <= 1e-6, f"{config}: merged {name}"
