"""Expert parallelism composed with the other axes (issue 43's gaps), on real gloo groups: a tiny Qwen3-MoE
(4 experts, top-2, built from a config, fp32) under ``tm.Trainer``, 3 AdamW steps of the global batch, against
one process on the same batches (``moe_cases.reference``): per-step losses, the first step's gradients and
the parameters after 3 steps within 1e-6.

Launch 1 (4 processes):

* pipe 2 x data 2 with ``expert_parallel_size=1``: EP smaller than a stage's data axis, each process of a
  stage holding every expert of its stage's layer (a group of one), the two holders' expert gradients
  averaged by the pipeline runner (ZeRO 0) or by the experts' own FSDP2 unit over the replicas (ZeRO-3);
* the zero-bubble schedules (``interleaved_zero_bubble`` and ``zbv``, 4 stages of one MoE layer, 2 per
  process) x EP 2 over the data axis: their split backward runs the dispatch's input and weight halves apart;
* ZeRO-1 with experts laid out: refused by name on every process before any collective (ModelParallel
  offers ZeRO 0, 2 and 3; ZeRO-2 x EP and ZeRO-3 x EP are tested in test_expert_parallel).

Launch 2 (8 processes), 1F1B, 2 microbatches: pipe 2 x data 2 x model 2, experts over the data axis (EP 2),
the rest tensor-parallel over the model axis as ``LayoutMap.auto`` lays it out (attention); and pipe 2 x
data 4 with ``expert_parallel_size=2``: each stage's data axis in two groups of 2 that dispatch within
themselves, each expert's gradient averaged over its 2 holders by the pipeline runner.
"""

from __future__ import annotations

import functools

import pytest
import torch

from trainmesh.testing import run_distributed

from moe_cases import (
    NUM_EXPERTS,
    lm_loss,
    make_optimizer,
    moe_model,
    fit_recording,
    reference,
)

pytestmark = [pytest.mark.dist]
pytest.importorskip("transformers")
TOL = 1e-6
# name: (mesh shape, axes, schedule, ZeRO stage, expert_parallel_size, layers)
CASES4 = {
    "pipe2_data2_ep1": ((2, 2), ["pipe", "data"], "1f1b", 0, 1, 2),
    "pipe2_data2_ep1_zero3": ((2, 2), ["pipe", "data"], "1f1b", 3, 1, 2),
    "interleaved_zero_bubble_ep2": ((2, 2), ["pipe", "data"], "interleaved_zero_bubble", 0, None, 4),
    "zbv_ep2": ((2, 2), ["pipe", "data"], "zbv", 0, None, 4),
}
CASES8 = {
    "pipe2_ep2_tp2": ((2, 2, 2), ["pipe", "data", "model"], "1f1b", 0, None, 2),
    # EP 2 on a stage's data axis of 4: two groups of 2 dispatching within themselves, replicas averaged
    "pipe2_data4_ep2": ((2, 4), ["pipe", "data"], "1f1b", 0, 2, 2),
}


def _fit(shape, axes, schedule, zero_stage, ep, layers) -> dict:
    import trainmesh as tm

    model = moe_model("qwen3_moe", layers=layers)
    mesh = tm.DeviceMesh(shape, axes, devices=tm.list_devices())
    layout_map = tm.LayoutMap.auto(model, mesh, expert_axis="data", expert_parallel_size=ep, verbose=False)
    pipeline = tm.Pipeline(axis="pipe", schedule=schedule, microbatches=2)
    distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data", pipeline=pipeline)
    trainer, params, grads, logs = fit_recording(model, distribution, zero_stage)
    experts = [p for n, p in trainer.model.named_parameters() if n.endswith("experts.gate_up_proj")]
    return {
        "params": params,
        "grads": grads,
        "losses": [record.get("loss") for record in logs],
        "expert_rows": [_local(p).shape[0] for p in experts],
        # rows of the attention's q_proj this process holds, of the whole (TP over a model axis halves them)
        "q_rows": [(_local(p).shape[0], p.shape[0]) for n, p in trainer.model.named_parameters() if "q_proj" in n],
    }


def _local(param):
    return param.to_local() if hasattr(param, "to_local") else param


def _zero1_refused() -> str:
    import trainmesh as tm

    model = moe_model("qwen3_moe")
    mesh = tm.DeviceMesh((4,), ["data"], devices=tm.list_devices())
    layout_map = tm.LayoutMap.auto(model, mesh, expert_axis="data", verbose=False)
    distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    try:
        tm.Trainer(model, make_optimizer, lm_loss, distribution=distribution, zero_stage=1, progress=False)
    except ValueError as error:
        return str(error)
    return "not refused"


def _cases(cases: dict) -> dict:
    out = {}
    for name, case in cases.items():
        try:
            out[name] = _fit(*case)
        except Exception as error:  # noqa: BLE001 -- reported per case, the others still run
            out[name] = f"{type(error).__name__}: {error}"
    if len(cases) == len(CASES4):
        out["zero1"] = _zero1_refused()
    return out


def _merged(results: list[dict], name: str, key: str) -> dict:
    merged: dict = {}
    for rank_result in results:
        for param, value in rank_result[name][key].items():
            if param in merged:  # the processes of a stage hold the same whole values
                assert torch.equal(merged[param], value), (name, key, param)
            merged[param] = value
    return merged


def _max_diff(got: dict, want: dict) -> tuple[float, str]:
    assert set(got) == set(want), set(got) ^ set(want)
    return max(((got[k] - want[k]).abs().max().item(), k) for k in want)


@functools.cache
def _reference(layers: int) -> dict:
    return reference("qwen3_moe", layers=layers)


def _check_parity(results: list[dict], name: str, layers: int) -> None:
    assert all(isinstance(r[name], dict) for r in results), [r[name] for r in results if not isinstance(r[name], dict)]
    want = _reference(layers)
    assert results[-1][name]["losses"] == pytest.approx(want["losses"], abs=TOL)  # the last stage's loss
    grad_diff, param = _max_diff(_merged(results, name, "grads"), want["grads"])
    assert grad_diff <= TOL, (name, param, grad_diff)
    param_diff, param = _max_diff(_merged(results, name, "params"), want["params"])
    assert param_diff <= TOL, (name, param, param_diff)
    print(name, "grads", grad_diff, "params", param_diff)


@pytest.fixture(scope="module")
def results4():
    return run_distributed(_cases, world_size=4, args=(CASES4,), timeout=400)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("name", list(CASES4))
def test_pipe_ep_compositions_match_one_process(results4, name):
    shape, axes, schedule, zero_stage, ep, layers = CASES4[name]
    _check_parity(results4, name, layers)
    held = NUM_EXPERTS // (ep or shape[axes.index("data")])
    if zero_stage == 3:  # the experts' own FSDP2 unit shards them over their 2 holders
        held //= 2
    stage_layers = layers // 2  # per process: 2 pipe ranks
    for rank_result in results4:
        assert rank_result[name]["expert_rows"] == [held] * stage_layers, (name, rank_result[name]["expert_rows"])
        if zero_stage == 0:  # no model axis here: whole attention weights (ZeRO-3 shards them over data)
            assert all(local == whole for local, whole in rank_result[name]["q_rows"]), rank_result[name]["q_rows"]


@pytest.mark.timeout(450)
def test_ep_with_zero1_is_refused_by_name(results4):
    for rank_result in results4:
        assert "stage 1 alone is not offered" in rank_result["zero1"], rank_result["zero1"]
        assert "zero_stage=1" in rank_result["zero1"]


@pytest.mark.timeout(450)
def test_eight_processes_match_one_process():
    """pipe 2 x EP 2 x TP 2, and pipe 2 x data 4 with EP 2 (EP smaller than the stage's data axis), in one launch."""
    results = run_distributed(_cases, world_size=8, args=(CASES8,), timeout=400)
    for name in CASES8:
        _check_parity(results, name, 2)
    for rank_result in results:
        assert rank_result["pipe2_ep2_tp2"]["expert_rows"] == [NUM_EXPERTS // 2]
        assert rank_result["pipe2_ep2_tp2"]["q_rows"] == [(16, 32)]  # the stage's one layer, half on each
        assert rank_result["pipe2_data4_ep2"]["expert_rows"] == [NUM_EXPERTS // 2]
        assert all(local == whole for local, whole in rank_result["pipe2_data4_ep2"]["q_rows"])
