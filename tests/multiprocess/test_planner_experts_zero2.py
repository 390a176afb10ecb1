"""The planner's EP x ZeRO-2 and EP x TP counts (``planner/experts.py``) against what a real process holds.

Four gloo processes train the planner tests' tiny Qwen3-MoE (2 MoE layers of 8 experts, hidden 16) for one
AdamW step under ``ModelParallel(zero_stage=2)`` at EP 4 and at EP 2 (two groups of 2 holding every expert
once, each experts module sharded over the 2 holding it); rank 0 (the rank the planner dry-runs) reports
the bytes of its parameter, gradient and AdamW state storages, local shards, FSDP2's padding included.
The plan is ``plan_parallel``'s own path: one dry run at ZeRO-2 and ``apply_expert_parallel`` at each EP.
At this size (8 experts on 4, EP dividing them) a process holds 2 expert rows at either EP, as ZeRO-2
alone gives: under ZeRO, EP moves the traffic and the gathered buffers (tests/unit/test_planner_experts.py),
not the bytes held. EP 2 x TP 2 (data 2 x model 2, stage 0) is checked the same way, against
``plan_parallel(..., mesh="data=2,model=2", expert_parallel_size=2)``. The plan runs in ``bf16-true`` (torch's meta kernel for ``grouped_mm`` refuses fp32)
and the real model in fp32, so the two are compared per element: planned bytes x 2 (AdamW's step scalars, fp32 in both, counted once).
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed
from trainmesh.testing.tiny_models import tiny_qwen3_moe_config

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]  # ~3 min at load 25 on 2 cores
transformers = pytest.importorskip("transformers")

# The dry run counts 16 parameter bytes (bf16) the real process does not hold, at ZeRO-2 without EP too
# (its own padding of the small dense tensors): 32 in fp32. Tolerance: 64 bytes of ~30 KB, 0.2%.
TOLERANCE_BYTES = 64


def _held(ep: int, shape=(4,), axes=("data",), zero_stage: int = 2) -> dict:
    import trainmesh as tm
    from trainmesh.planner.dry_run import _storage_bytes

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config())
    mesh = tm.DeviceMesh(shape, list(axes), devices=tm.list_devices())
    layout_map = tm.LayoutMap.auto(model, mesh, expert_axis="data", expert_parallel_size=ep, verbose=False)
    distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data", zero_stage=zero_stage)
    model = distribution.distribute_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(tm.rank()))
    logits = model(ids[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    params = list(model.parameters())
    states = [v for p in params for v in opt.state[p].values() if torch.is_tensor(v)]  # AdamW's step scalars too
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(p.grad for p in params),
        "optimizer": _storage_bytes(states),
        "steps": sum(1 for v in states if v.dim() == 0),
        "expert_params": _storage_bytes(experts),
    }


def _worker() -> dict:
    # EP 4 and EP 2 at ZeRO-2; EP 2 x TP 2 (data 2 x model 2, stage 0: dense layers TP-sharded, experts
    # EP-sharded over data and replicated over model)
    return {**{ep: _held(ep) for ep in (4, 2)}, "tp": _held(2, (2, 2), ("data", "model"), 0)}


def test_ep_by_zero2_and_by_tp_plans_count_what_each_process_holds():
    from trainmesh.planner.experts import apply_expert_parallel, expert_bytes
    from trainmesh.planner.mesh_spec import MeshSpec
    from trainmesh.planner.parallel import plan_parallel

    real = run_distributed(_worker, world_size=4, timeout=400)[0]
    spec = MeshSpec.parse("data=4", 4)

    def meta():
        with torch.device("meta"):
            return transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).to(torch.bfloat16)

    dry = plan_parallel(
        meta(), world_size=4, mesh="data=4", seq_len=8, hardware=None, precision="bf16-true", zero_stage=2
    )
    rank0 = next(r for r in dry.ranks if r.rank == 0)
    got = {}
    for ep in (4, 2):
        planned = apply_expert_parallel(
            rank0, meta(), spec, expert_parallel_size=ep, zero_stage=2, precision="bf16-true", tokens=8
        )
        experts = expert_bytes(meta(), spec, expert_parallel_size=ep, zero_stage=2, precision="bf16-true")["all"][1]
        steps = 4 * real[ep]["steps"]  # fp32 step scalars, in the dry run's count as in the real one: not doubled
        got[ep] = {
            "expert_params": 2 * experts,
            "params": 2 * planned.params,
            "grads": 2 * planned.grads,
            "optimizer": 2 * (planned.optimizer - steps) + steps,
        }
    kwargs = dict(world_size=4, mesh="data=2,model=2", seq_len=8, hardware=None, precision="bf16-true")
    tp_planned = next(r for r in plan_parallel(meta(), expert_parallel_size=2, **kwargs).ranks if r.rank == 0)
    tp_alone = next(r for r in plan_parallel(meta(), **kwargs).ranks if r.rank == 0)
    # without EP the dry run holds every expert (replicated over data, no TP entry): 12,288 more fp32 bytes
    assert 2 * tp_alone.params - real["tp"]["params"] > 12_000
    steps = 4 * real["tp"]["steps"]
    tp_spec = MeshSpec.parse("data=2,model=2", 4)
    got["tp"] = {
        "expert_params": 2
        * expert_bytes(meta(), tp_spec, expert_parallel_size=2, zero_stage=0, precision="bf16-true")["all"][1],
        "params": 2 * tp_planned.params,
        "grads": 2 * tp_planned.grads,
        "optimizer": 2 * (tp_planned.optimizer - steps) + steps,
    }
    print("rank 0 bytes, planned x 2 / held:", got, real)
    for ep in (4, 2, "tp"):
        assert got[ep]["expert_params"] == real[ep]["expert_params"], ep  # the experts alone: exact
        for key in ("params", "grads", "optimizer"):
            assert abs(got[ep][key] - real[ep][key]) <= TOLERANCE_BYTES, (ep, key)
