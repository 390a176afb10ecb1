"""A meta-built transformers MoE model loads with ``weights=`` from the directory transformers' own
``save_pretrained`` wrote (per-expert ``experts.{e}.gate_proj.weight`` ... tensors, while the model holds
fused ``experts.gate_up_proj`` / ``experts.down_proj``).

One launch of 2 gloo processes loads a tiny Qwen3-MoE (4 experts, 2 layers, from a config: no download)
at EP 2 (alone and with ZeRO-3), under ZeRO-3 and under plain DataParallel. Every parameter and buffer equals what
``from_pretrained`` loads on one process, exactly (torch.equal: the bytes are copied, never computed). At
EP 2 (both) each process reads exactly its own experts' tensors (experts 0-1 or 2-3 of every layer), half the
experts' bytes, and every non-expert tensor once. One backward on each process's half of a batch then gives
one process's gradients on the whole batch (1e-6): the gradient hooks hold the filled parameters.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from trainmesh.testing import run_distributed

from moe_cases import data, lm_loss, moe_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

pytestmark = pytest.mark.timeout(300)

WORLD, NUM_EXPERTS = 2, 4
LAYOUTS = ("ep2", "ep2_zero3", "zero3", "dp")


def _full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().clone()


def _load(directory: str, layout: str):
    """The model built on the meta device, laid out as ``layout`` and filled from ``directory``; the
    names and bytes each read of a file tensor took."""
    import trainmesh as tm
    from trainmesh._torch.sync import unwrap
    from trainmesh.checkpoint.safetensors_reader import WeightFiles

    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    reads: dict[str, int] = {}
    original = WeightFiles.read_region

    def counted(self, name, offsets, shape, out=None, fd=None):
        if fd is not None:  # the outer call (fd None) re-enters with its descriptor: count once
            reads[name] = reads.get(name, 0) + math.prod(shape) * self.entries[name].dtype.itemsize
        return original(self, name, offsets, shape, out, fd)

    if layout.startswith("ep2"):
        mesh = tm.DeviceMesh((WORLD,), ["data"], devices=tm.list_devices())
        layout_map = tm.LayoutMap.auto(model, mesh, expert_axis="data", verbose=False)
        zero_stage = 3 if layout == "ep2_zero3" else 0
        distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data", zero_stage=zero_stage)
    else:
        distribution = tm.DataParallel(zero_stage=3 if layout == "zero3" else 0)
    WeightFiles.read_region = counted
    try:
        model = distribution.distribute_model(model, weights=directory)
    finally:
        WeightFiles.read_region = original
    # one backward on this process's half of a batch: the gradients equal one process's on the whole batch
    # (the hooks that average them over the batch axis were set on the filled parameters)
    import torch.distributed as dist

    x, y = data(steps=1)
    rows = slice(dist.get_rank() * len(x) // WORLD, (dist.get_rank() + 1) * len(x) // WORLD)
    lm_loss(model(x[rows]), y[rows]).backward()
    model = unwrap(model)  # DataParallel's DDP wrapper names everything module.*
    grads = {k: _full(p.grad) for k, p in model.named_parameters()}
    local_experts = sum(
        p.to_local().numel() for n, p in model.named_parameters() if ".experts." in n and layout.startswith("ep2")
    )
    state = {k: _full(v) for k, v in [*model.state_dict().items(), *model.named_buffers()]}
    return state, reads, local_experts, grads


def _job(directory: str):
    return {layout: _load(directory, layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3_moe_pretrained"))
    moe_model("qwen3_moe", seed=3, num_experts=NUM_EXPERTS).save_pretrained(directory)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory)
    want = {k: v.detach().clone() for k, v in [*reference.state_dict().items(), *reference.named_buffers()]}
    from safetensors import safe_open

    x, y = data(steps=1)
    lm_loss(reference(x), y).backward()
    want_grads = {k: p.grad.detach().clone() for k, p in reference.named_parameters()}
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        stored = {k: f.get_slice(k).get_shape() for k in f.keys()}
    return run_distributed(_job, world_size=WORLD, args=(directory,), timeout=240), want, stored, want_grads


def test_the_directory_holds_per_expert_tensors(loaded):
    _, want, stored, _ = loaded
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in stored
    assert "model.layers.0.mlp.experts.gate_up_proj" in want
    assert not any(k.endswith("experts.gate_up_proj") for k in stored)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_tensor_equals_from_pretrained(loaded, layout):
    results, want, _, _ = loaded
    for rank in range(WORLD):
        got = results[rank][layout][0]
        assert set(got) == set(want)
        unequal = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
        assert not unequal, (layout, rank, unequal[:4])


@pytest.mark.parametrize("layout", ["ep2", "ep2_zero3"])
def test_at_ep2_each_process_reads_only_its_experts(loaded, layout):
    results, _, stored, _ = loaded
    itemsize = 4  # fp32 files
    expert_bytes = sum(math.prod(s) for k, s in stored.items() if ".experts." in k) * itemsize
    other_bytes = sum(math.prod(s) for k, s in stored.items() if ".experts." not in k) * itemsize
    for rank in range(WORLD):
        _, reads, local_experts, _ = results[rank][layout]
        mine = range(rank * NUM_EXPERTS // WORLD, (rank + 1) * NUM_EXPERTS // WORLD)
        expected_experts = {k for k in stored if any(f".experts.{e}." in k for e in mine)}
        assert {k for k in reads if ".experts." in k} == expected_experts
        read_expert_bytes = sum(v for k, v in reads.items() if ".experts." in k)
        assert read_expert_bytes == expert_bytes // WORLD == local_experts * itemsize
        if layout == "ep2":  # the rest replicated: read whole (under ZeRO-3 each reads its FSDP2 shard)
            assert {k for k in reads if ".experts." not in k} == {k for k in stored if ".experts." not in k}
            assert sum(reads.values()) == expert_bytes // WORLD + other_bytes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_first_gradients_equal_one_process(loaded, layout):
    results, _, _, want = loaded
    for rank in range(WORLD):
        got = results[rank][layout][3]
        assert set(got) == set(want)
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst < 1e-6, (layout, rank, worst)
