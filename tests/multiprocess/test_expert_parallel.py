"""Expert parallelism on real gloo groups: tiny transformers Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 and GPT-OSS
(built from a config) against one process on the same global batches, in fp32.

Launch 1 (2 processes, a hand-written loop so gradients can be read): EP 2 over the data axis for the five
models (DeepSeek-V3: sigmoid group-limited router with its correction bias, a shared expert, a dense first
layer; GPT-OSS: attention sinks, biased experts), for a router forced to send every token to experts 0 and 1 (both on the first process: the
second receives no row), and with the auxiliary load-balancing loss over the global batch
(``trainmesh.moe.load_balancing_loss`` against transformers' own on one process). Checked: losses and first-step gradients (1e-6), parameters after 3 AdamW
steps (1e-6), one count exchange and two token exchanges forward and two backward per MoE layer, and
expert parameters per process exactly 1/EP of the model's. In the same launch, ``tm.Trainer`` fits of
DeepSeek-V3 with ``callbacks=[RouterBiasBalancing(rate=...)]`` (with and without accumulation 2) against
the same fit on one process: the bias ``torch.equal``, parameters within 1e-6.

Launch 2 (4 processes, ``tm.Trainer``): launch 1's sharded checkpoint (EP 2, after one epoch) resumed at
EP 4 for a second epoch against one process's two epochs; EP 4 with global-norm clipping; EP 4 x ZeRO-3;
EP 2 x TP 2 (experts over the data axis, attention over the model axis); experts over the model axis;
EP 4 with gradient accumulation 2; EP 4 with full activation checkpointing (the dispatch recomputed in
backward); EP 4 with ``nonfinite_loss=None`` (the expert counts logged without a loss check to ride on).
Parameters after 3 steps within 1e-6.

lr 1e-3 (eps 1e-5): Adam moves a weight by about lr whatever its gradient's size, so the fp32 noise of
summing a dense gradient over processes in another order than one process (~1e-8, the same under plain
data parallelism) grows to lr x 1e-4 in the weights; at lr 1e-2 that was 1.3e-6 in a dense v_proj.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from trainmesh.testing import run_distributed

from moe_cases import (
    AUX_COEF,
    BIAS_RATE,
    GLOBAL_BATCH,
    NUM_EXPERTS,
    STEPS,
    data,
    lm_loss,
    make_optimizer,
    moe_model,
    reference,
    routing_counts,
    SEQ,
    skew_router,
    transformers_aux_loss,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
pytest.importorskip("transformers")
TOL = 1e-6

LOOP_CASES = [  # family, variant
    ("qwen3_moe", ""),
    ("mixtral", ""),
    ("olmoe", ""),
    ("deepseek_v3", ""),
    ("gpt_oss", ""),
    ("qwen3_moe", "skewed"),
    ("qwen3_moe", "aux"),
    ("deepseek_v3", "bias"),
]
TRAINER_CASES = [  # name, family, mesh shape, axes, expert axis, Trainer options
    ("ep4_clip", "qwen3_moe", (4,), ["data"], "data", dict(max_grad_norm=0.5)),
    ("ep4_zero3", "qwen3_moe", (4,), ["data"], "data", dict(zero_stage=3)),
    ("ep4_zero2", "qwen3_moe", (4,), ["data"], "data", dict(zero_stage=2)),  # (ZeRO-1 alone: refused by ModelParallel)
    ("ep2_tp2", "mixtral", (2, 2), ["data", "model"], "data", dict()),
    ("experts_over_model_axis", "mixtral", (2, 2), ["data", "model"], "model", dict()),
    ("ep4_accumulation2", "mixtral", (4,), ["data"], "data", dict(grad_accum_steps=2)),
    ("ep4_checkpointing", "mixtral", (4,), ["data"], "data", dict(activation_checkpointing="full")),
    # EP 2 on a batch axis of 4: two groups of 2 processes each hold every expert once. ZeRO-3 shards each
    # expert over the 2 processes holding it; at stage 0 those 2 average its gradient. max_grad_norm far
    # above the norm: no clipping, but the step's global norm is logged and checked (AdamW's update would
    # hide a gradient off by a constant factor)
    ("ep2_zero3_on4", "qwen3_moe", (4,), ["data"], "data", dict(zero_stage=3, ep=2, max_grad_norm=1e3)),
    ("ep2_on4_accumulation2", "qwen3_moe", (4,), ["data"], "data", dict(ep=2, grad_accum_steps=2, max_grad_norm=1e3)),
    # no per-step loss all-reduce to ride on: the expert counts are reduced on their own, on logged steps only
    ("ep4_unchecked", "qwen3_moe", (4,), ["data"], "data", dict(nonfinite_loss=None, log_every_n_steps=2)),
]


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _loop_cases(save_dir: str, checkpoint_dir: str) -> dict:
    import torch.distributed as dist

    import trainmesh as tm
    from trainmesh.moe import RouterBiasBalancing, dispatch_stats, load_balancing_loss, reset_dispatch_stats
    from trainmesh.planner.collectives import CollectiveCounter, CollectiveLog

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for family, variant in LOOP_CASES:
        mesh = tm.DeviceMesh((world,), ["data"], devices=tm.list_devices())
        model = moe_model(family, router_logits=variant == "aux")
        if variant == "skewed":
            skew_router(model)
        full_expert_numel = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        layout_map = tm.LayoutMap.auto(model, mesh, expert_axis="data", verbose=False)
        distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data")
        model = distribution.distribute_model(model)
        opt = make_optimizer(model.parameters())
        balancing = RouterBiasBalancing(model, BIAS_RATE, distribution=distribution) if variant == "bias" else None
        x, y = data()
        local = GLOBAL_BATCH // world
        losses, grads, stats = [], None, None
        for step in range(STEPS):
            rows = slice(step * GLOBAL_BATCH + rank * local, step * GLOBAL_BATCH + (rank + 1) * local)
            opt.zero_grad()
            reset_dispatch_stats(model)
            log = CollectiveLog()
            with CollectiveCounter({}, log=log):  # the dispatcher's view, independent of dispatch_stats
                outputs = model(x[rows])
                loss = lm_loss(outputs, y[rows])
                if variant == "aux":
                    aux = load_balancing_loss(outputs.router_logits, NUM_EXPERTS, 2, distribution=distribution)
                    loss = loss + AUX_COEF * aux
                    # per process, transformers' own value differs from the global one (checked below)
                    aux_local = float(transformers_aux_loss(outputs))
                loss.backward()
            if step == 0:
                all_to_all = sum(t.count for (_, kind), t in log.traffic.items() if kind == "all_to_all")
            if stats is None:
                stats = dispatch_stats(model)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world)
            if grads is None:
                grads = {k: _full(p.grad).detach().clone() for k, p in model.named_parameters()}
            opt.step()
            if balancing is not None:
                balancing.step()
        local_expert_numel = sum(p.to_local().numel() for n, p in model.named_parameters() if ".experts." in n)
        state = {k: _full(v).detach().clone() for k, v in model.state_dict().items()}
        if variant == "" and family == "qwen3_moe":
            tm.save_pretrained(model, save_dir)  # collective: the experts gathered from both processes
        out[(family, variant)] = {
            "losses": losses,
            "grads": grads,
            "params": state,
            "stats": stats,
            "expert_numel": (local_expert_numel, full_expert_numel),
            "all_to_all": all_to_all,
        }
        if variant == "aux":
            out[(family, variant)]["aux"] = (float(aux), aux_local)
    for accumulation in (1, 2):  # DeepSeek-V3's bias balancing as a Trainer callback (the trainer's model)
        out[("bias_callback", accumulation)] = _bias_callback_fit(
            tm.DeviceMesh((world,), ["data"], devices=tm.list_devices()), accumulation
        )
    # a sharded training checkpoint at EP 2, resumed at EP 4 by the second launch
    model = moe_model("qwen3_moe")
    layout_map = tm.LayoutMap.auto(
        model, tm.DeviceMesh((world,), ["data"], devices=tm.list_devices()), expert_axis="data", verbose=False
    )
    trainer = tm.Trainer(
        model,
        make_optimizer,
        lm_loss,
        progress=False,
        distribution=tm.ModelParallel(layout_map=layout_map, batch_dim_name="data"),
        callbacks=[tm.ShardedCheckpoint(checkpoint_dir, async_save=False)],
    )
    trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
    return out


def _bias_callback_fit(mesh, accumulation: int) -> dict:
    """``tm.Trainer`` with ``callbacks=[RouterBiasBalancing(rate=BIAS_RATE)]`` on DeepSeek-V3 for 3 steps;
    ``mesh`` None: one process. This process's own bias (each process updates its copy) and the state."""
    import trainmesh as tm
    from trainmesh.moe import RouterBiasBalancing

    model = moe_model("deepseek_v3")
    distribution = None
    if mesh is not None:
        layout_map = tm.LayoutMap.auto(model, mesh, expert_axis="data", verbose=False)
        distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    trainer = tm.Trainer(
        model,
        make_optimizer,
        lm_loss,
        progress=False,
        distribution=distribution,
        grad_accum_steps=accumulation,
        callbacks=[RouterBiasBalancing(rate=BIAS_RATE)],
    )
    trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
    bias = trainer.unwrapped_model.get_submodule("model.layers.1.mlp.gate").e_score_correction_bias
    state = trainer.state_dict()["model"]  # gathered on the main process
    return {"bias": _full(bias).detach().clone(), "params": {k: _full(v).detach().clone() for k, v in state.items()}}


@pytest.fixture(scope="module")
def loop_results(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("ep2_save") / "qwen3_moe")
    checkpoint_dir = str(tmp_path_factory.mktemp("ep2_checkpoint"))
    results = run_distributed(_loop_cases, world_size=2, args=(save_dir, checkpoint_dir), timeout=400)
    results[0]["save_dir"], results[0]["checkpoint_dir"] = save_dir, checkpoint_dir
    # the EP 2 checkpoint as launch 1 left it (the 4-process test resumes from checkpoint_dir and saves there)
    results[0]["ep2_checkpoint_copy"] = shutil.copytree(checkpoint_dir, tmp_path_factory.mktemp("ep2_copy") / "c")
    return results, {
        case: reference(case[0], skew=case[1] == "skewed", aux=case[1] == "aux", bias=case[1] == "bias")
        for case in LOOP_CASES
    }


def _max_diff(got: dict, want: dict) -> tuple[float, str]:
    assert set(got) == set(want)
    return max(((got[k] - want[k]).abs().max().item(), k) for k in want)


@pytest.mark.parametrize("case", LOOP_CASES, ids=[f"{f}_{v}".rstrip("_") for f, v in LOOP_CASES])
def test_ep2_matches_one_process(loop_results, case):
    results, references = loop_results
    got, want = results[0][case], references[case]
    assert got["losses"] == pytest.approx(want["losses"], abs=TOL)
    grad_diff, name = _max_diff(got["grads"], want["grads"])
    assert grad_diff <= TOL, name
    param_diff, name = _max_diff(got["params"], want["params"])
    assert param_diff <= TOL, name
    for rank_result in results[1:]:  # every process holds the same whole model after gathering
        assert _max_diff(rank_result[case]["params"], got["params"])[0] == 0.0


def test_skewed_routing_leaves_a_process_without_rows(loop_results):
    results, _ = loop_results
    stats = results[1][("qwen3_moe", "skewed")]["stats"]
    for layer in stats.values():  # every pair went to experts 0 and 1, both on process 0
        assert layer["tokens_per_expert"].tolist()[2:] == [0, 0]
        assert layer["tokens_per_expert"].sum().item() == (GLOBAL_BATCH // 2) * 8 * 2  # rows x seq x top-k


def test_collectives_per_moe_layer_and_expert_memory(loop_results):
    results, _ = loop_results
    for rank_result in results:
        for case in LOOP_CASES:
            stats = rank_result[case]["stats"]
            # the MoE layers (DeepSeek-V3's first layer is dense: first_k_dense_replace=1); no dense layer
            # dispatches
            moe_layers = 1 if case[0] == "deepseek_v3" else 2
            assert len(stats) == moe_layers
            # c10d all-to-alls in a forward + backward, counted at the dispatcher: layers x (1 + 2 + 2)
            assert rank_result[case]["all_to_all"] == moe_layers * 5
            for layer in stats.values():
                assert (
                    layer["count_exchanges"],
                    layer["token_exchanges_forward"],
                    layer["token_exchanges_backward"],
                ) == (1, 2, 2)
            local, full = rank_result[case]["expert_numel"]
            assert local * 2 == full  # exactly 1/EP of the experts on each process


def _trainer_cases(checkpoint_dir: str) -> dict:
    import trainmesh as tm

    out = {}
    # the EP 2 checkpoint of launch 1, resumed at EP 4 for a second epoch (model and AdamW state resharded)
    model = moe_model("qwen3_moe")
    layout_map = tm.LayoutMap.auto(
        model, tm.DeviceMesh((4,), ["data"], devices=tm.list_devices()), expert_axis="data", verbose=False
    )

    class CountSteps(tm.Callback):
        ran = 0

        def on_train_batch_end(self, step, logs=None):
            CountSteps.ran += 1

    trainer = tm.Trainer(
        model,
        make_optimizer,
        lm_loss,
        progress=False,
        distribution=tm.ModelParallel(layout_map=layout_map, batch_dim_name="data"),
        callbacks=[tm.ShardedCheckpoint(checkpoint_dir, async_save=False), CountSteps()],
    )
    trainer.fit(data(), epochs=2, batch_size=GLOBAL_BATCH, shuffle=False, resume=True)
    out["resumed_ep2_to_ep4"] = {k: v.detach().clone() for k, v in trainer.state_dict()["model"].items()}
    out["resumed_steps"] = CountSteps.ran
    out.update(_composition_cases())
    return out


def _composition_cases() -> dict:
    import trainmesh as tm
    from trainmesh.planner.dry_run import _storage_bytes

    out = {}

    class StepLogs(tm.Callback):
        def __init__(self):
            self.norms, self.tokens, self.imbalance = [], [], []

        def on_train_batch_end(self, step, logs=None):
            self.norms.append(float(logs.get("grad_norm", float("nan"))))
            self.tokens.append(logs.get("moe_tokens_per_expert"))
            self.imbalance.append(logs.get("moe_imbalance"))

    for name, family, shape, axes, expert_axis, options in TRAINER_CASES:
        options = dict(options)
        ep = options.pop("ep", None)
        mesh = tm.DeviceMesh(shape, axes, devices=tm.list_devices())
        model = moe_model(family)
        layout_map = tm.LayoutMap.auto(model, mesh, expert_axis=expert_axis, expert_parallel_size=ep, verbose=False)
        distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data")
        norms = StepLogs()
        trainer = tm.Trainer(
            model, make_optimizer, lm_loss, distribution=distribution, progress=False, callbacks=[norms], **options
        )
        trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
        experts = trainer.model.model.layers[0].mlp.experts.gate_up_proj
        state = trainer.state_dict()["model"]  # gathered on the main process
        out[name] = {k: v.detach().clone() for k, v in state.items()}
        out[f"{name}_norms"] = norms.norms
        out[f"{name}_load"] = (norms.tokens, norms.imbalance)
        out[f"{name}_expert_rows"] = (experts.to_local().shape[0], experts.shape[0])
        # what this process holds (results come back from rank 0, the rank the planner dry-runs), counted
        # as the planner counts storages: the planner's expert-parallel figures are checked against it
        held = [(n, p) for n, p in trainer.model.named_parameters()]
        out[f"{name}_param_bytes"] = (
            _storage_bytes(p for _, p in held),
            _storage_bytes(p for n, p in held if ".experts." in n),
        )
    return out


def test_ep_composes_on_four_processes(loop_results):
    checkpoint_dir = loop_results[0][0]["checkpoint_dir"]
    results = run_distributed(_trainer_cases, world_size=4, args=(checkpoint_dir,), timeout=560)[0]
    assert results["resumed_steps"] == STEPS  # only the second epoch ran: the first came from the EP 2 checkpoint
    worst = {"resumed_ep2_to_ep4": _max_diff(results["resumed_ep2_to_ep4"], reference("qwen3_moe", epochs=2)["params"])}
    for name, family, _, _, _, options in TRAINER_CASES:
        want = reference(family, accumulation=options.get("grad_accum_steps", 1), max_norm=options.get("max_grad_norm"))
        worst[name] = _max_diff(results[name], want["params"])
        if options.get("max_grad_norm") == 1e3:  # unclipped: the first step's global norm is one process's
            first = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want["grads"].values()]))
            assert results[f"{name}_norms"][0] == pytest.approx(float(first), rel=1e-5), name
        # the Trainer's log: each step's tokens per expert over the global batch (riding the loss check)
        tokens, imbalance = results[f"{name}_load"]
        if options.get("nonfinite_loss", "skip") is None:
            # logged steps only (global steps 2 and 3, the epoch's last), each its own step's counts (not
            # the window's): the same as the checked run of the same model (ep4_zero3: no clipping either)
            assert tokens[0] is None and imbalance[0] is None, name
            assert tokens[1:] == results["ep4_zero3_load"][0][1:], name
            tokens, imbalance = tokens[1:], imbalance[1:]
        else:
            assert tokens[0] == routing_counts(family), name  # one process's routing of the first batch
        assert all(sum(layer) == GLOBAL_BATCH * SEQ * 2 for step in tokens for layer in step), name  # x top-k
        want_imbalance = [max(max(c) * NUM_EXPERTS / sum(c) for c in step) for step in tokens]
        assert imbalance == pytest.approx(want_imbalance, rel=1e-12) and min(imbalance) > 1.0, name
    assert all(diff <= TOL for diff, _ in worst.values()), worst
    # EP 2 x ZeRO-3 on 4: each process holds a quarter of the experts (half by EP, half of that by ZeRO)
    assert results["ep2_zero3_on4_expert_rows"] == (1, NUM_EXPERTS)
    assert results["ep2_on4_accumulation2_expert_rows"] == (2, NUM_EXPERTS)
    _planner_counts_what_ep_holds(results)


def _planner_counts_what_ep_holds(results: dict) -> None:
    """``trainmesh plan``'s expert-parallel counts (planner/experts.py: what replaces the dry run's expert
    bytes) against the expert bytes the real EP models above held on rank 0, the rank the planner dry-runs:
    EP 4, EP 4 x ZeRO-3, EP 2 x ZeRO-3 on 4 and EP 2 x data 2. (A whole plan_parallel dry run of this MoE
    costs ~50 s on a loaded 2-core machine, so the dense layers' dry-run bytes are not re-checked here.)"""
    from trainmesh.planner.experts import expert_bytes
    from trainmesh.planner.mesh_spec import MeshSpec

    spec = MeshSpec.parse("data=4", 4)
    with torch.device("meta"):
        meta = moe_model("qwen3_moe")
    layouts = [("ep4_clip", 4, 0), ("ep4_zero3", 4, 3), ("ep2_zero3_on4", 2, 3), ("ep2_on4_accumulation2", 2, 0)]
    for name, ep, stage in layouts:
        counted = expert_bytes(meta, spec, expert_parallel_size=ep, zero_stage=stage, precision="32")
        assert counted["all"][1] == results[f"{name}_param_bytes"][1], (name, counted, results[f"{name}_param_bytes"])
    print("rank 0 parameter bytes (all, experts):", {n: results[f"{n}_param_bytes"] for n, _, _ in layouts})


def test_auxiliary_loss_is_the_global_batch_s(loop_results):
    """The losses above already include it (parity of losses, gradients and parameters with one process's
    transformers' aux loss); here: each process's own transformers value differs, so the check has teeth."""
    results, _ = loop_results
    global_values = {round(r[("qwen3_moe", "aux")]["aux"][0], 6) for r in results}
    local_values = [r[("qwen3_moe", "aux")]["aux"][1] for r in results]
    assert len(global_values) == 1  # the same on every process
    assert all(abs(v - next(iter(global_values))) > 1e-4 for v in local_values)


def test_save_pretrained_from_ep2_loads_in_transformers(loop_results, tmp_path):
    """``tm.save_pretrained`` of the EP 2 model writes the names transformers' own ``save_pretrained`` writes
    (per-expert ``experts.{e}.gate_proj.weight``, ..., each written from the process holding that expert), and
    plain ``from_pretrained`` reads them back exactly (the same tensors as the gathered state)."""
    import glob

    import transformers
    from safetensors import safe_open

    def names(directory):
        found = set()
        for path in glob.glob(f"{directory}/*.safetensors"):
            with safe_open(path, "pt") as f:
                found |= set(f.keys())
        return found

    results, _ = loop_results
    moe_model("qwen3_moe").save_pretrained(tmp_path / "hf")
    written = names(results[0]["save_dir"])
    assert written == names(tmp_path / "hf")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in written
    loaded = transformers.AutoModelForCausalLM.from_pretrained(results[0]["save_dir"], dtype="float32")
    state = loaded.state_dict()
    want = results[0][("qwen3_moe", "")]["params"]
    assert set(state) == set(want)
    assert all(torch.equal(state[k], want[k]) for k in want)


def test_ep2_checkpoint_resumes_on_one_process(loop_results, tmp_path):
    """Launch 1's sharded checkpoint (EP 2: each process wrote its own experts and their AdamW state)
    loaded by one process with whole experts (EP 1) for the second epoch: one process's two epochs.
    A copy, so that this process's own saves leave launch 1's directory as it was."""
    import trainmesh as tm

    class CountSteps(tm.Callback):
        ran = 0

        def on_train_batch_end(self, step, logs=None):
            CountSteps.ran += 1

    checkpoint_dir = shutil.copytree(loop_results[0][0]["ep2_checkpoint_copy"], tmp_path / "ep2")
    trainer = tm.Trainer(
        moe_model("qwen3_moe"),
        make_optimizer,
        lm_loss,
        progress=False,
        callbacks=[tm.ShardedCheckpoint(str(checkpoint_dir), async_save=False), CountSteps()],
    )
    trainer.fit(data(), epochs=2, batch_size=GLOBAL_BATCH, shuffle=False, resume=True)
    assert (CountSteps.ran, trainer.global_step) == (STEPS, 2 * STEPS)  # the first epoch came from the checkpoint
    got = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    diff, name = _max_diff(got, reference("qwen3_moe", epochs=2)["params"])
    assert diff <= TOL, name


def test_router_bias_update_is_the_global_batch_s(loop_results):
    """DeepSeek-V3's bias after 3 updates: moved (so steps 2-3 route by it), one process's value on the global
    batch's loads (the parity case above checks it within 1e-6 with the rest of the state), and bit-identical
    on every process."""
    results, references = loop_results
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    want = references[("deepseek_v3", "bias")]["params"][name]
    assert want.abs().min() > 0  # every expert's bias moved
    # and the bias after step 1 changed step 2's routing: its loss differs from the run without updates
    with_bias, without = references[("deepseek_v3", "bias")]["losses"], references[("deepseek_v3", "")]["losses"]
    assert with_bias[0] == without[0] and abs(with_bias[1] - without[1]) > 1e-5
    for rank_result in results:
        assert torch.equal(rank_result[("deepseek_v3", "bias")]["params"][name], want)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_router_bias_callback_under_the_trainer_matches_one_process(loop_results, accumulation):
    """``tm.Trainer(..., callbacks=[RouterBiasBalancing(rate=...)])`` at EP 2 (launch 1) against the same fit on
    one process, with and without accumulation 2: the bias ``torch.equal`` on both processes and to one
    process's, the parameters within 1e-6 after 3 steps; and one process's fit is the hand-written update
    (``moe_cases.reference``: counts over all micro-batches of a step, one update per step)."""
    results, _ = loop_results
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    one = _bias_callback_fit(None, accumulation)
    written = reference("deepseek_v3", accumulation=accumulation, bias=True)["params"]
    assert one["bias"].abs().min() > 0  # every expert's bias moved
    assert torch.equal(one["bias"], written[name])
    diff, worst = _max_diff(one["params"], written)
    assert diff <= TOL, (worst, diff)
    for rank_result in results:
        assert torch.equal(rank_result[("bias_callback", accumulation)]["bias"], one["bias"])
    assert torch.equal(results[0][("bias_callback", accumulation)]["params"][name], one["bias"])
    diff, worst = _max_diff(results[0][("bias_callback", accumulation)]["params"], one["params"])
    assert diff <= TOL, (worst, diff)
    print(f"bias callback, accumulation {accumulation}: EP 2 vs one process max |diff| {diff:.2e} ({worst})")
