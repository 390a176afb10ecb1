"""Bad LoRA input is named before anything is distributed: a target module the model lacks, an
adapter rank split over more devices than it has rows."""

from __future__ import annotations

import pytest
import torch

import trainmesh as tm
from trainmesh.distribution.adapters import check_lora_targets

pytestmark = pytest.mark.timeout(120)
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=8,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _loss(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())


def test_a_misspelt_target_beside_a_real_one_is_named():
    # peft itself accepts this config: only a config whose every target is missing is refused there
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_projj"]))
    with pytest.raises(ValueError, match=r"\['v_projj'\] are not in the model.*'v_proj'"):
        check_lora_targets(model)


@pytest.mark.usefixtures("no_process_group_left_behind")
def test_the_trainer_refuses_it_before_starting_a_process_group():
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "gate_projection"]))
    with pytest.raises(ValueError, match="gate_projection"):
        tm.Trainer(model, torch.optim.SGD, _loss, progress=False)
    assert not torch.distributed.is_initialized()


def test_real_targets_and_regex_targets_pass():
    check_lora_targets(peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"])))
    check_lora_targets(peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=r".*\.(k|o)_proj")))
    check_lora_targets(_llama())  # not a peft model: nothing to check


def test_a_rank_split_over_more_devices_than_it_has_is_named():
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    mesh = tm.DeviceMesh((1, 4), ["data", "model"], devices=[f"cpu:{i}" for i in range(4)])
    layout_map = tm.LayoutMap(mesh)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    layout_map[name] = ("model", None)  # rank 2 (dim 0 of lora_A) over a model axis of 4
    shape = dict(model.named_parameters())[name].shape
    with pytest.raises(ValueError, match=r"q_proj\.lora_A\.default\.weight.*size 2.*not divisible.*'model' \(size 4\)"):
        layout_map[name].validate_for_shape(shape, name)
