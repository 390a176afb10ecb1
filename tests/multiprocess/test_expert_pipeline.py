"""Pipe 2 x EP 2 on real gloo groups (issue 43): a tiny Qwen3-MoE (2 MoE layers, 4 experts, top-2, built from
a config, fp32) on a ("pipe", "data") = (2, 2) mesh with ``expert_axis="data"``: each stage holds one MoE layer
whose experts are split over the stage's two data processes, tokens dispatched within that pair by all-to-all.

One launch of 4 processes, ``tm.Trainer``, 3 AdamW steps of the global batch in 2 microbatches, against one
process on the same batches (``moe_cases.reference``): per-step losses, the first step's gradients and the
parameters after 3 steps within 1e-6, under GPipe (its layout from ``LayoutMap.auto(model, mesh, expert_axis="data")``), 1F1B, 1F1B x ZeRO-3
and interleaved 1F1B (a 4-layer model: 4 stages, 2 per process). Also checked: each process holds
half its stage's experts; the Trainer's per-expert token counts are one process's routing of the first batch
(torch's shape inference on the first step routes uninitialised tensors, which must not count); a model asked
for its router logits (the auxiliary loss) is refused by name under the pipe, on every process, before any
collective.
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed

from moe_cases import (
    GLOBAL_BATCH,
    NUM_EXPERTS,
    lm_loss,
    moe_model,
    fit_recording,
    reference,
    routing_counts,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
pytest.importorskip("transformers")
TOL = 1e-6
# schedule, ZeRO stage; interleaved 1F1B: 4 stages of one MoE layer each, 2 per process (a 4-layer model)
CASES = [("gpipe", 0), ("1f1b", 0), ("1f1b", 3), ("interleaved_1f1b", 0)]
LAYERS = {"interleaved_1f1b": 4}


def _distribution(schedule: str, model=None):
    """Experts over the data axis, everything else replicated within a stage: written out, or (``model``
    given: the GPipe case) by ``LayoutMap.auto(model, mesh, expert_axis="data")``, which on a
    ("pipe", "data") mesh lays out no tensor parallelism."""
    import trainmesh as tm

    mesh = tm.DeviceMesh((2, 2), ["pipe", "data"], devices=tm.list_devices())
    if model is not None:
        layout_map = tm.LayoutMap.auto(model, mesh, expert_axis="data", verbose=False)
    else:
        layout_map = tm.LayoutMap(mesh)
        layout_map["model.layers.*.mlp.experts.gate_up_proj"] = ("data", None, None)
        layout_map["model.layers.*.mlp.experts.down_proj"] = ("data", None, None)
    pipeline = tm.Pipeline(axis="pipe", schedule=schedule, microbatches=2)
    return tm.ModelParallel(layout_map=layout_map, batch_dim_name="data", pipeline=pipeline)


def _fit(schedule: str, zero_stage: int) -> dict:

    model = moe_model("qwen3_moe", layers=LAYERS.get(schedule, 2))
    distribution = _distribution(schedule, model if schedule == "gpipe" else None)
    trainer, params, grads, logs = fit_recording(model, distribution, zero_stage)
    experts = [p for n, p in trainer.model.named_parameters() if n.endswith("experts.gate_up_proj")]
    return {
        "params": params,
        "grads": grads,
        "losses": [record.get("loss") for record in logs],
        "tokens": [record.get("moe_tokens_per_expert") for record in logs],
        "expert_rows": [(_local_rows(p), p.shape[0]) for p in experts],
    }


def _local_rows(param) -> int:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.shape[0]


def _aux_refused() -> str:
    import trainmesh as tm

    model = moe_model("qwen3_moe", router_logits=True)
    distribution = _distribution("1f1b")
    try:
        tm.Trainer(model, torch.optim.SGD, lm_loss, distribution=distribution, progress=False)
    except ValueError as error:
        return str(error)
    return "not refused"


def _cases() -> dict:
    out = {case: _fit(*case) for case in CASES}
    out["aux"] = _aux_refused()
    return out


@pytest.fixture(scope="module")
def results():
    wants = {layers: reference("qwen3_moe", layers=layers) for layers in {2, *LAYERS.values()}}
    return run_distributed(_cases, world_size=4, timeout=240), wants, routing_counts("qwen3_moe")


def _merged(results: list[dict], case, key: str) -> dict:
    merged: dict = {}
    for rank_result in results:
        for name, value in rank_result[case][key].items():
            if name in merged:  # the two processes of a stage hold the same whole values
                assert torch.equal(merged[name], value), (case, key, name)
            merged[name] = value
    return merged


def _max_diff(got: dict, want: dict) -> tuple[float, str]:
    assert set(got) == set(want), set(got) ^ set(want)
    return max(((got[k] - want[k]).abs().max().item(), k) for k in want)


@pytest.mark.parametrize("case", CASES, ids=[f"{s}_zero{z}" for s, z in CASES])
def test_pipe2_ep2_matches_one_process(results, case):
    results, wants, routing = results
    want = wants[LAYERS.get(case[0], 2)]
    losses = results[-1][case]["losses"]  # the Trainer reports the last stage's loss everywhere
    assert losses == pytest.approx(want["losses"], abs=TOL)
    grad_diff, name = _max_diff(_merged(results, case, "grads"), want["grads"])
    assert grad_diff <= TOL, (name, grad_diff)
    param_diff, name = _max_diff(_merged(results, case, "params"), want["params"])
    assert param_diff <= TOL, (name, param_diff)
    for rank_result in results:  # one MoE layer per stage, half its experts on each process of the stage
        rows = rank_result[case]["expert_rows"]
        layers_held = LAYERS.get(case[0], 2) // 2
        assert rows == [(NUM_EXPERTS // 2, NUM_EXPERTS)] * layers_held, rows  # ZeRO-3 leaves EP's experts alone
        # the Trainer's log: the global batch's tokens per expert of both layers, not shape inference's
        tokens = rank_result[case]["tokens"][0]
        if case[0] in LAYERS:  # a 4-layer model: every layer's counts add up to tokens x top-k
            assert len(tokens) == 4 and all(sum(layer) == GLOBAL_BATCH * 8 * 2 for layer in tokens), tokens
        else:
            assert tokens == routing, tokens


def test_auxiliary_loss_is_refused_under_the_pipe_by_name(results):
    results = results[0]
    for rank_result in results:
        assert "auxiliary load-balancing loss is not offered with a pipeline over 'pipe'" in rank_result["aux"]
        assert "output_router_logits=True" in rank_result["aux"]
