"""The pieces of benchmarks/zero_memory.py and benchmarks/tensor_parallel.py that decide what a
figure is compared with and whether the two sides did the same work: the ZeRO model-state formulas
per precision, the DeepSpeed config per precision, and tensor_parallel's same-work check (it must
pass fp32 summation-order noise and fail a one-in-a-thousand gradient error or a parameter the
optimizer skipped)."""

import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def zero_memory():
    return _load("zero_memory")


@pytest.fixture(scope="module")
def tensor_parallel():
    return _load("tensor_parallel")


@pytest.mark.timeout(60)
def test_fp32_formula_is_4_4_8_sharded_per_zero_stage(zero_memory):
    p, n = 1_000_000, 4
    expected = {0: 16 * p, 1: 4 * p + 4 * p + 8 * p / n, 2: 4 * p + (4 + 8) * p / n, 3: 16 * p / n}
    for stage, bytes_ in expected.items():
        assert zero_memory.formulas(p, n, stage)["fp32_4_4_8"] == pytest.approx(bytes_)
    paper = {0: 16 * p, 1: 2 * p + 2 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}
    for stage, bytes_ in paper.items():
        assert zero_memory.formulas(p, n, stage)["paper_2_2_12"] == pytest.approx(bytes_)


@pytest.mark.timeout(60)
def test_each_precision_compares_with_its_own_zero_formula(zero_memory):
    assert zero_memory.PRECISIONS["fp32"]["zero_formula"] == "fp32_4_4_8"
    assert zero_memory.PRECISIONS["bf16-mixed"]["zero_formula"] == "paper_2_2_12"
    for stage in (1, 2, 3):
        assert zero_memory.matching_formula("deepspeed", stage, "fp32")[0] == "fp32_4_4_8"
        assert zero_memory.matching_formula("deepspeed", stage, "bf16-mixed")[0] == "paper_2_2_12"
        # trainmesh stores fp32 parameters and gradients under both precisions
        assert zero_memory.matching_formula("trainmesh", stage, "fp32") == zero_memory.matching_formula(
            "trainmesh", stage, "bf16-mixed"
        )
    # first-step losses: fp32 on both sides leaves only rounding, so the bound is far tighter
    assert zero_memory.PRECISIONS["fp32"]["loss_tolerance"] < zero_memory.PRECISIONS["bf16-mixed"]["loss_tolerance"]


@pytest.mark.timeout(60)
def test_deepspeed_config_has_a_precision_block_only_under_bf16(zero_memory):
    cfg = {"batch": 8, "nproc": 4, "precision": "fp32"}
    fp32 = zero_memory.deepspeed_config(cfg, 2, 1000)
    assert "bf16" not in fp32 and "fp16" not in fp32 and "communication_data_type" not in fp32
    bf16 = zero_memory.deepspeed_config({**cfg, "precision": "bf16-mixed"}, 3, 1000)
    assert bf16["bf16"] == {"enabled": True}
    assert bf16["zero_optimization"]["stage3_prefetch_bucket_size"] == 1000
    assert fp32["train_micro_batch_size_per_gpu"] == 2
    assert zero_memory.PRECISIONS["fp32"]["tm_reduce_dtype"] is None  # fp32 reduction: trainmesh's default
    assert zero_memory.choose_precision("fp32") == ("fp32", "given with --precision")


def _sides(seed=0):
    torch.manual_seed(seed)
    params = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    return params, grads


@pytest.mark.timeout(60)
def test_tp_same_work_passes_rounding_noise(tensor_parallel):
    start, grads = _sides()
    update = {k: 1e-3 * torch.randn_like(v) for k, v in start.items()}
    noisy = {k: g * (1 + 1e-7 * torch.randn_like(g)) for k, g in grads.items()}
    first = {"trainmesh": {"loss": 5.0, "grads": noisy}, "hand-written": {"loss": 5.0, "grads": grads}}
    end_hw = {k: start[k] + update[k] for k in start}
    end_tm = {k: start[k] + update[k] * (1 + 1e-4 * torch.randn_like(update[k])) for k in start}
    check = tensor_parallel.same_work(first, start, {"trainmesh": end_tm, "hand-written": end_hw})
    assert check["first_grad_rel_l2_max"] <= tensor_parallel.GRAD_REL_L2
    assert check["update_rel_l2_max"] <= tensor_parallel.UPDATE_REL_L2


@pytest.mark.timeout(60)
def test_tp_same_work_fails_different_work(tensor_parallel):
    start, grads = _sides()
    update = {k: 1e-3 * torch.randn_like(v) for k, v in start.items()}
    end_hw = {k: start[k] + update[k] for k in start}
    # one gradient 0.1% off (a wrong scale on one reduction), everything else equal
    off = {**grads, "b": grads["b"] * 1.001}
    first = {"trainmesh": {"loss": 5.0, "grads": off}, "hand-written": {"loss": 5.0, "grads": grads}}
    check = tensor_parallel.same_work(first, start, {"trainmesh": end_hw, "hand-written": end_hw})
    assert check["first_grad_rel_l2_max"] > tensor_parallel.GRAD_REL_L2
    # one parameter the optimizer skipped: its trained change is 100% off
    first = {"trainmesh": {"loss": 5.0, "grads": grads}, "hand-written": {"loss": 5.0, "grads": grads}}
    skipped = {**end_hw, "b": start["b"].clone()}
    check = tensor_parallel.same_work(first, start, {"trainmesh": skipped, "hand-written": end_hw})
    assert check["update_rel_l2_max"] == pytest.approx(1.0)
    assert check["update_worst"] == "b"
