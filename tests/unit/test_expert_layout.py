"""Experts in the layout API, in one process (pure description, no process group): what
``LayoutMap.auto(..., expert_axis=...)`` lays out and prints, where it finds the experts, and the clear
errors for a layout that cannot be applied, raised before any collective could start."""

from __future__ import annotations

import pytest
import torch

import trainmesh as tm
from trainmesh.distribution.expert_layout import build_expert_plan, find_experts
from trainmesh.testing.tiny_models import tiny_qwen3_moe_config

pytestmark = pytest.mark.timeout(120)
transformers = pytest.importorskip("transformers")


def _qwen3_moe(num_experts: int = 4):
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config(num_experts))


def _mesh(*shape, axes=("data",)):
    size = 1
    for s in shape:
        size *= s
    return tm.DeviceMesh(shape, list(axes), devices=[f"cpu:{i}" for i in range(size)])


EXPERT_PARAMS = [f"model.layers.{i}.mlp.experts.{n}" for i in range(2) for n in ("gate_up_proj", "down_proj")]


def test_auto_lays_every_expert_parameter_over_the_axis_and_prints_it(capsys):
    model = _qwen3_moe()
    layout_map = tm.LayoutMap.auto(model, _mesh(2), expert_axis="data")
    assert sorted(k.replace("\\", "") for k in layout_map) == sorted(EXPERT_PARAMS)
    for path in EXPERT_PARAMS:
        assert layout_map[path].axes == ("data", None, None)
    assert layout_map["model.layers.0.mlp.gate.weight"] is None  # the router stays replicated
    printed = capsys.readouterr().out
    assert "base_model_ep_plan" in printed and "model.layers.1.mlp.experts.down_proj: ('data', None, None)" in printed
    assert "2 per process over data=2" in printed


def test_auto_on_a_two_axis_mesh_adds_tensor_parallel_attention():
    model = _qwen3_moe()
    layout_map = tm.LayoutMap.auto(model, _mesh(2, 2, axes=("data", "model")), expert_axis="data", verbose=False)
    assert layout_map["model.layers.0.self_attn.q_proj.weight"].axes == ("model", None)
    assert layout_map["model.layers.0.mlp.experts.gate_up_proj"].axes == ("data", None, None)


def test_auto_on_a_pipe_data_mesh_lays_out_experts_only_and_prints_them(capsys):
    """("pipe", "data") has no model axis: no tensor-parallel entry (the last axis, "data", is the batch
    axis), the experts over "data", printed; ("pipe", "model") keeps its tensor parallelism."""
    model = _qwen3_moe()
    layout_map = tm.LayoutMap.auto(model, _mesh(2, 2, axes=("pipe", "data")), expert_axis="data")
    assert sorted(k.replace("\\", "") for k in layout_map) == sorted(EXPERT_PARAMS)
    assert all(layout_map[p].axes == ("data", None, None) for p in EXPERT_PARAMS)
    assert layout_map["model.layers.0.self_attn.q_proj.weight"] is None
    printed = capsys.readouterr().out
    assert "experts of Qwen3MoeForCausalLM" in printed and "tensor-parallel plan" not in printed
    assert not len(tm.LayoutMap.auto(model, _mesh(2, 2, axes=("pipe", "data")), verbose=False))
    piped_tp = tm.LayoutMap.auto(model, _mesh(2, 2, axes=("pipe", "model")), verbose=False)
    assert piped_tp["model.layers.0.self_attn.q_proj.weight"].axes == ("model", None)
    # a sequence axis splits the sequence, not tensors: ("data", "seq") gets no tensor parallelism either
    assert not len(tm.LayoutMap.auto(model, _mesh(2, 2, axes=("data", "seq")), verbose=False))
    beside_seq = tm.LayoutMap.auto(model, _mesh(1, 2, 2, axes=("data", "seq", "model")), verbose=False)
    assert beside_seq["model.layers.0.self_attn.q_proj.weight"].axes == ("model", None)


def test_experts_are_found_by_structure_without_a_shipped_plan():
    model = _qwen3_moe()
    model.config.base_model_ep_plan = None
    found, source = find_experts(model)
    assert source == "the module tree"
    assert [m.path for m in found] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert found[0].param_names == ("gate_up_proj", "down_proj") and found[0].router_path == "model.layers.0.mlp.gate"


def test_explicit_entries_build_the_plan_the_engine_applies():
    model = _qwen3_moe()
    layout_map = tm.LayoutMap(_mesh(2))
    layout_map[r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)"] = ("data", None, None)
    plan = build_expert_plan(model, tm.ModelParallel(layout_map=layout_map, batch_dim_name="data"))
    assert plan.axis == "data" and plan.size == 2 and plan.param_paths() == set(EXPERT_PARAMS)


def test_experts_that_do_not_divide_over_the_axis_are_named():
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts' holds 4 experts.*axis 'data' of size 3"):
        tm.LayoutMap.auto(_qwen3_moe(), _mesh(3), expert_axis="data", verbose=False)


def test_expert_axis_on_a_model_without_experts():
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with pytest.raises(ValueError, match=r"expert_axis='data' was given but LlamaForCausalLM has no experts"):
        tm.LayoutMap.auto(dense, _mesh(2), expert_axis="data", verbose=False)
    layout_map = tm.LayoutMap(_mesh(2))
    layout_map["model.layers.*.mlp.experts.gate_up_proj"] = ("data", None, None)
    with pytest.raises(ValueError, match=r"lays out experts .* LlamaForCausalLM has no experts module"):
        build_expert_plan(dense, tm.ModelParallel(layout_map=layout_map, batch_dim_name="data"))


def test_an_unsupported_router_is_named():
    model = _qwen3_moe()
    del model.model.layers[1].mlp.gate.top_k  # not a top-k router any more
    with pytest.raises(
        ValueError,
        match=r"Router 'model.layers.1.mlp.gate' \(Qwen3MoeTopKRouter\) is not a supported "
        r"router for expert parallelism over axis 'data'",
    ):
        tm.LayoutMap.auto(model, _mesh(2), expert_axis="data", verbose=False)


def test_a_layout_inside_an_expert_or_a_partial_one_is_refused():
    model = _qwen3_moe()
    mesh = _mesh(2, 2, axes=("data", "model"))
    layout_map = tm.LayoutMap(mesh)
    layout_map["model.layers.0.mlp.experts.gate_up_proj"] = ("data", "model", None)
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.experts.gate_up_proj' may be laid out .* \(dim 0\) only"
    ):
        build_expert_plan(model, tm.ModelParallel(layout_map=layout_map, batch_dim_name="data"))
    layout_map = tm.LayoutMap(mesh)
    layout_map["model.layers.0.mlp.experts.gate_up_proj"] = ("data", None, None)
    with pytest.raises(ValueError, match=r"experts module 'model.layers.0.mlp.experts' are laid out over different"):
        build_expert_plan(model, tm.ModelParallel(layout_map=layout_map, batch_dim_name="data"))


def test_load_balancing_loss_on_one_process_is_transformers_own():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from trainmesh.moe import load_balancing_loss

    torch.manual_seed(0)
    logits = tuple(torch.randn(12, 4, requires_grad=True) for _ in range(2))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    for attention_mask in (None, mask):
        ours = load_balancing_loss(logits, 4, 2, attention_mask, distribution=None)
        theirs = load_balancing_loss_func(logits, 4, 2, attention_mask)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        grads = torch.autograd.grad(ours, logits)
        want = torch.autograd.grad(theirs, logits)
        for got, expected in zip(grads, want):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="needs the model output's router_logits"):
        load_balancing_loss(None, 4, 2)


def test_experts_with_a_pipeline_are_planned_and_the_auxiliary_loss_refused_by_name():
    """Pipe 2 x EP 2 is planned (its parity with one process: multiprocess/test_expert_pipeline.py); a model
    asked for its router logits (the auxiliary loss) is refused under the pipe by name, before any collective."""
    from trainmesh._torch.pipeline_experts import check_aux_loss, expert_layers

    model = _qwen3_moe()
    mesh = _mesh(2, 2, axes=("pipe", "data"))
    distribution = tm.ModelParallel(layout_map=tm.LayoutMap(mesh), batch_dim_name="data", pipeline=tm.Pipeline())
    for name in ("gate_up_proj", "down_proj"):
        distribution.layout_map[f"model.layers.*.mlp.experts.{name}"] = ("data", None, None)
    plan = build_expert_plan(model, distribution)
    assert (plan.axis, plan.size, len(plan.modules)) == ("data", 2, 2)
    assert expert_layers(model, distribution) == [(f"model.layers.{i}.mlp.experts", 4) for i in range(2)]
    check_aux_loss(model, "pipe")  # router logits not asked for: accepted
    model.config.output_router_logits = True
    with pytest.raises(
        ValueError,
        match=r"auxiliary load-balancing loss is not offered with a pipeline over 'pipe'.*output_router_logits",
    ):
        check_aux_loss(model, "pipe")


def test_expert_parallel_size_splits_the_batch_axis_into_groups(capsys):
    model = _qwen3_moe()
    layout_map = tm.LayoutMap.auto(model, _mesh(4), expert_axis="data", expert_parallel_size=2)
    assert "2 per process over data=4 in 2 groups of 2 processes" in capsys.readouterr().out
    plan = build_expert_plan(model, tm.ModelParallel(layout_map=layout_map, batch_dim_name="data"))
    assert (plan.axis, plan.size, plan.axis_size, plan.replicas) == ("data", 2, 4, 2)
    with pytest.raises(ValueError, match=r"expert_parallel_size must be a positive divisor.*'data' \(4\).*=3"):
        tm.LayoutMap.auto(model, _mesh(4), expert_axis="data", expert_parallel_size=3, verbose=False)
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.experts' holds 6 experts.*=4 processes of mesh axis 'data'"
    ):
        tm.LayoutMap.auto(_qwen3_moe(6), _mesh(8), expert_axis="data", expert_parallel_size=4, verbose=False)
    # groups along a model axis would see the same tokens: refused, naming the axis
    layout_map = tm.LayoutMap.auto(
        model, _mesh(2, 4, axes=("data", "model")), expert_axis="model", expert_parallel_size=2, verbose=False
    )
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 smaller than expert axis 'model' \(4\).*batch"):
        build_expert_plan(model, tm.ModelParallel(layout_map=layout_map, batch_dim_name="data"))


def test_router_bias_balancing_refuses_a_model_without_bias_router_and_a_bad_rate():
    from trainmesh.moe import RouterBiasBalancing

    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM has no router with an 'e_score_correction_bias'"):
        RouterBiasBalancing(_qwen3_moe(), rate=1e-3)
    for rate in (0, -1e-3, True):
        with pytest.raises(ValueError, match=r"needs a positive rate"):
            RouterBiasBalancing(_qwen3_moe(), rate=rate)


def _tiny_deepseek_v3():
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=0, num_experts_per_tok=1, q_lora_rank=8, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=8,
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(config)


def test_router_bias_balancing_on_one_process_moves_each_bias_by_rate():
    """One process, no distribution: each expert's bias moves by +-rate (or 0) by its own load; evaluation
    forwards are not counted."""
    from trainmesh.moe import RouterBiasBalancing

    model = _tiny_deepseek_v3()
    gate = model.model.layers[0].mlp.gate
    seen = []
    gate.register_forward_hook(lambda m, a, out: seen.append(torch.bincount(out[2].reshape(-1), minlength=4)))
    balancing = RouterBiasBalancing(model, rate=0.5)
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    model(tokens)
    with torch.no_grad():
        model(tokens)  # not counted
    counts = balancing.step()["model.layers.0.mlp.gate"]
    assert torch.equal(counts, seen[0]) and int(counts.sum()) == 32
    load = seen[0].float()
    assert torch.equal(gate.e_score_correction_bias, 0.5 * torch.sign(load.mean() - load))
    assert all(int(c.sum()) == 0 for c in balancing.counts)  # zeroed for the next step


def test_router_bias_balancing_as_a_trainer_callback_skips_what_the_trainer_skipped():
    """``callbacks=[RouterBiasBalancing(rate=...)]`` takes the trainer's model: the bias moves after each
    applied step by the step's counts, not after a step the Trainer skipped (a non-finite loss: the
    record's ``skipped``), and the evaluation forwards of ``eval_data`` are not counted. Refused: a rate
    passed where the model goes."""
    from trainmesh.moe import RouterBiasBalancing

    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module \(pass the rate by name"):
        RouterBiasBalancing(1e-3)
    calls = []

    def loss_fn(outputs, targets):  # the second step's loss (its 1 micro-batch) is nan
        calls.append(1)
        loss = torch.nn.functional.cross_entropy(outputs.logits.reshape(-1, 32), targets.reshape(-1))
        return loss * float("nan") if len(calls) == 2 else loss

    model = _tiny_deepseek_v3()
    gate = model.model.layers[0].mlp.gate
    loads = []  # every training forward's counts; evaluation forwards run under no_grad

    def count(module, args, out):
        if torch.is_grad_enabled():
            loads.append(torch.bincount(out[2].reshape(-1), minlength=4))

    gate.register_forward_hook(count)
    balancing = RouterBiasBalancing(rate=0.5)
    biases, at_test_end = [], []
    watch = tm.LambdaCallback(
        on_train_batch_end=lambda step, logs: biases.append(gate.e_score_correction_bias.clone()),
        on_test_end=lambda logs: at_test_end.append(int(sum(c.sum() for c in balancing.counts))),
    )
    trainer = tm.Trainer(
        model, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn, progress=False, callbacks=[balancing, watch]
    )
    tokens = torch.randint(0, 32, (12, 9), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    trainer.fit((x, y), batch_size=4, shuffle=False, eval_data=(x[:4], y[:4]))
    assert trainer.nonfinite_steps == 1 and len(loads) == 3 and len(biases) == 3
    want = torch.zeros(4)
    for step, load in enumerate(loads):
        if step != 1:  # the skipped step: no update
            want = want + 0.5 * torch.sign(load.float().mean() - load.float())
        assert torch.equal(biases[step], want), step
    assert biases[0].abs().min() > 0 and torch.equal(biases[1], biases[0])
    assert at_test_end == [0]  # evaluate's forwards (no grad) were not counted
    assert balancing.routers == [] and len(gate._forward_hooks) == 1  # its hook taken off at the end of fit


def test_experts_beside_a_sequence_axis_are_planned_and_beside_a_pipeline_refused_by_name():
    """Experts over the batch axis or over the sequence axis itself, beside a sequence axis, are planned
    (their gradients are averaged over the processes holding the same experts, _torch/expert_grads.py;
    parity in tests/multiprocess/test_expert_sequence.py). With a pipeline as well, the runner reduces a
    stage's gradients its own way, unchecked with a sequence axis: refused by name before any collective."""
    model = _qwen3_moe()
    mesh = _mesh(2, 2, axes=("data", "seq"))
    for axis in ("data", "seq"):
        layout_map = tm.LayoutMap.auto(model, mesh, expert_axis=axis, verbose=False)
        distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data", sequence_dim_name="seq")
        plan = build_expert_plan(model, distribution)
        assert plan.axis == axis and plan.size == 2 and len(plan.modules) == 2
    piped = _mesh(2, 2, 2, axes=("pipe", "data", "seq"))
    layout_map = tm.LayoutMap.auto(model, piped, expert_axis="data", verbose=False)
    distribution = tm.ModelParallel(
        layout_map=layout_map, batch_dim_name="data", sequence_dim_name="seq", pipeline=tm.Pipeline(axis="pipe")
    )
    with pytest.raises(ValueError, match=r"beside a sequence axis 'seq' and a pipeline over 'pipe'.*layers\.0"):
        build_expert_plan(model, distribution)
