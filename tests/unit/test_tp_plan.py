"""The tensor-parallel plan and ``LayoutMap.auto`` on real module trees, in one process (no collective)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainmesh as tm
from trainmesh._torch.tp_plan import build_tp_plan
from trainmesh._torch.tensor_parallel import parameter_layouts

pytestmark = pytest.mark.timeout(120)
transformers = pytest.importorskip("transformers")


def mesh(shape):
    return tm.DeviceMesh(shape, ["data", "model"], devices=[f"cpu:{i}" for i in range(shape[0] * shape[1])])


def llama(kv_heads=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config)


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def plan_of(model, layout_map):
    distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    layouts = parameter_layouts(model, distribution)
    m = layout_map.device_mesh
    return build_tp_plan(
        model, layouts, batch_axis="data", model_axes=["model"], axis_sizes={a: m.axis_size(a) for a in m.axis_names}
    )


def test_auto_uses_the_models_own_plan_and_pairs_megatron_style(capsys):
    layout_map = tm.LayoutMap.auto(llama(), mesh((2, 2)))
    assert "the model's own tensor-parallel plan" in capsys.readouterr().out
    plan = plan_of(llama(), layout_map)
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert {p: plan[p].style for p in (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.o_proj")} == {
        f"{attn}.q_proj": "colwise",
        f"{attn}.k_proj": "colwise",
        f"{attn}.o_proj": "rowwise",
    }
    # Activations stay sharded between the pair: no gather after q/k/v, o takes shards.
    assert not plan[f"{attn}.q_proj"].gather_output and plan[f"{attn}.o_proj"].sharded_input
    assert not plan[f"{mlp}.up_proj"].gather_output and plan[f"{mlp}.down_proj"].sharded_input
    assert plan["lm_head"].style == "colwise" and plan["lm_head"].gather_output  # vocab-parallel head


def test_auto_derives_a_plan_for_gpt2_conv1d_and_gathers_the_fused_qkv(capsys):
    layout_map = tm.LayoutMap.auto(gpt2(), mesh((2, 2)))
    assert "derived from the module tree" in capsys.readouterr().out
    assert layout_map["transformer.h.0.attn.c_attn.weight"].axes == (None, "model")  # Conv1D: in x out
    assert layout_map["transformer.h.0.mlp.c_proj.weight"].axes == ("model", None)
    assert layout_map["transformer.wte.weight"].axes == ("model", None)  # vocab-parallel
    plan = plan_of(gpt2(), layout_map)
    # c_attn's 3 x hidden output is split by GPT-2's own code at fixed offsets: gathered.
    assert plan["transformer.h.0.attn.c_attn"].gather_output
    assert not plan["transformer.h.0.attn.c_proj"].sharded_input
    assert not plan["transformer.h.0.mlp.c_fc"].gather_output and plan["transformer.h.0.mlp.c_proj"].sharded_input
    # The head is tied to wte: it is planned too (one DTensor for both).
    assert plan["lm_head"].axes == {"weight": ("model", None)}


def test_auto_leaves_an_attention_whose_kv_heads_do_not_split_replicated_as_a_whole(capsys):
    layout_map = tm.LayoutMap.auto(llama(kv_heads=2), mesh((1, 4)))
    out = capsys.readouterr().out
    assert "model.layers.*.self_attn: left replicated as a whole" in out
    assert layout_map["model.layers.0.self_attn.q_proj.weight"] is None
    assert layout_map["model.layers.0.mlp.up_proj.weight"].axes == ("model", None)


def test_an_explicit_layout_whose_kv_heads_do_not_split_names_the_layer_and_numbers():
    layout_map = tm.LayoutMap(mesh((1, 4)))
    layout_map[r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj\.weight"] = ("model", None)
    layout_map[r"model\.layers\.\d+\.self_attn\.o_proj\.weight"] = (None, "model")
    with pytest.raises(ValueError, match=r"k_proj' holds 2 attention heads .* model axis of size 4"):
        plan_of(llama(kv_heads=2), layout_map)


def test_a_parameter_sharded_over_the_batch_axis_is_refused_before_any_collective():
    layout_map = tm.LayoutMap(mesh((2, 2)))
    layout_map[r"lm_head\.weight"] = ("data", None)
    with pytest.raises(ValueError, match=r"batch axis 'data'.*zero_stage=3"):
        plan_of(llama(), layout_map)


def test_an_unknown_module_with_a_layout_falls_back_to_dtensor_propagation():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(8, 4))

        def forward(self, x):
            return x * self.gain.sum(0)

    model = nn.Sequential(nn.Linear(4, 4), Scale())
    layout_map = tm.LayoutMap(mesh((2, 2)))
    layout_map[r"1\.gain"] = ("model", None)
    plan = plan_of(model, layout_map)
    assert plan["1"].style == "dtensor"


def test_auto_on_a_one_axis_mesh_is_empty_and_bad_axes_are_named():
    one_axis = tm.DeviceMesh((4,), ["data"], devices=[f"cpu:{i}" for i in range(4)])
    assert len(tm.LayoutMap.auto(gpt2(), one_axis)) == 0
    with pytest.raises(ValueError, match="model_axis 'tensor'"):
        tm.LayoutMap.auto(gpt2(), mesh((2, 2)), model_axis="tensor")


def test_a_key_that_matches_no_parameter_warns_and_names_it():
    from trainmesh._torch.tensor_parallel import _warn_unmatched_keys

    layout_map = tm.LayoutMap(mesh((2, 2)))
    layout_map[r"model\.layers\.\d+\.self_attn\.q_prj\.weight"] = ("model", None)  # typo
    layout_map[r"lm_head\.weight"] = ("model", None)
    distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    with pytest.warns(UserWarning, match=r"q_prj.*matches no parameter") as caught:
        _warn_unmatched_keys(llama(), distribution)
    assert len(caught) == 1  # the key that matches stays quiet


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_auto_plans_a_peft_model_as_its_base_head_included(family):
    """The derived plan (GPT-2) looked for the head among the model's own children: under peft it sits
    at base_model.model.lm_head and was left replicated while the plain model's was vocab-parallel."""
    peft = pytest.importorskip("peft")
    targets = ["c_attn", "c_fc"] if family == "gpt2" else ["q_proj", "down_proj"]
    plain = tm.LayoutMap.auto(gpt2() if family == "gpt2" else llama(), mesh((1, 2)), verbose=False)
    wrapped = tm.LayoutMap.auto(
        peft.get_peft_model(gpt2() if family == "gpt2" else llama(), peft.LoraConfig(r=2, target_modules=targets)),
        mesh((1, 2)),
        verbose=False,
    )

    def as_base(key: str) -> str:
        return key.replace("\\", "").removeprefix("base_model.model.").replace(".base_layer", "")

    assert {as_base(k) for k in wrapped.keys() if "lora_" not in k} == {as_base(k) for k in plain.keys()}
    assert any(as_base(k) == "lm_head.weight" for k in wrapped.keys())
