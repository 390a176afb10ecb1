"""Applying distributions on 4 real processes: bad input fails fast, good input is laid out.

One launch checks everything: each scenario records what happened on every rank, then the
group does one more all-reduce to prove no scenario left a rank stuck in a collective.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from trainmesh.testing import run_distributed

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples")))

import keras_model_parallel  # noqa: E402
import seed_model  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _error_of(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _scenarios() -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import trainmesh as tm

    rank = tm.rank()
    out: dict = {}
    data = seed_model.make_data()

    # --- errors that must surface before any collective --------------------------------
    big = tm.DeviceMesh((2, 4), ["data", "model"], devices=[f"cpu:{i}" for i in range(8)])
    big_map = tm.LayoutMap(big)
    big_map["d1.weight"] = ("model", None)
    out["mesh_too_big"] = _error_of(lambda: tm.ModelParallel(layout_map=big_map).distribute_model(seed_model.SeedModel()))
    foreign = tm.DeviceMesh((4,), ["batch"], devices=["cpu:0", "cpu:1", "cpu:2", "cpu:7"])
    out["foreign_devices"] = _error_of(lambda: tm.DataParallel(device_mesh=foreign).distribute_model(seed_model.SeedModel()))
    mesh = tm.DeviceMesh((1, 4), ["data", "model"], devices=tm.list_devices())
    uneven = tm.LayoutMap(mesh)
    uneven["d2.weight"] = ("model", None)  # 10 rows over 4 processes
    out["indivisible_dim"] = _error_of(lambda: tm.ModelParallel(layout_map=uneven).distribute_model(seed_model.SeedModel()))
    out["indivisible_batch"] = _error_of(lambda: tm.DataParallel().distribute_dataset(data, 6))
    out["not_a_module"] = _error_of(lambda: tm.DataParallel().distribute_model(lambda x: x))

    # --- replicas start identical even when every rank initialised differently ------------
    torch.manual_seed(100 + rank)
    dp_model = tm.DataParallel().distribute_model(seed_model.SeedModel())
    out["dp_d2_weight"] = dp_model.module.d2.weight.detach().clone()
    torch.manual_seed(200 + rank)
    mp = keras_model_parallel.build_distribution((2, 2))
    mp_model = mp.distribute_model(seed_model.SeedModel())
    out["mp_d2_weight_local"] = mp_model.d2.weight.to_local().detach().clone()
    out["mp_d1_weight_full"] = mp_model.d1.weight.full_tensor().detach().clone()

    # --- output layouts, global batches, global loss ------------------------------------------
    batches = mp.distribute_dataset(data, 16)
    inputs, labels = next(iter(batches))
    out["batch_is_dtensor"] = isinstance(inputs, DTensor)
    out["batch_placements"] = [str(p) for p in inputs.placements]
    out["batch_global_shape"] = tuple(inputs.shape)
    out["batch_local_shape"] = tuple(inputs.to_local().shape)
    output = mp_model(inputs)
    out["output_placements"] = [str(p) for p in output.placements]
    loss = torch.nn.functional.mse_loss(output, labels)
    out["loss_item"] = loss.item()  # global value, as one device would give
    out["loss_local"] = loss.to_local().item()
    loss.backward()
    out["grad_placements"] = {n: [str(p) for p in w.grad.placements] for n, w in mp_model.named_parameters()}
    out["param_placements"] = {n: [str(p) for p in w.placements] for n, w in mp_model.named_parameters()}

    # --- plain local tensors fed to the model are this rank's slice of the batch ---------------
    local_inputs = inputs.to_local()
    out["plain_input_output_placements"] = [str(p) for p in mp_model(local_inputs).placements]

    # Nothing above left a rank inside a collective.
    alive = torch.ones(1)
    dist.all_reduce(alive)
    out["alive"] = alive.item()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_scenarios, world_size=4, timeout=240)


def test_errors_are_clear_and_raised_on_every_rank(results):
    for r in results:
        assert r["mesh_too_big"].startswith("ValueError") and "needs 8 processes" in r["mesh_too_big"]
        assert r["foreign_devices"].startswith("ValueError") and "cpu:7" in r["foreign_devices"]
        assert r["indivisible_dim"].startswith("ValueError") and "d2.weight" in r["indivisible_dim"]
        assert r["indivisible_batch"].startswith("ValueError") and "global_batch_size=6" in r["indivisible_batch"]
        assert r["not_a_module"].startswith("TypeError")
        assert r["alive"] == 4.0


def test_replicas_start_identical(results):
    for r in results[1:]:
        torch.testing.assert_close(r["dp_d2_weight"], results[0]["dp_d2_weight"], rtol=0, atol=0)
        torch.testing.assert_close(r["mp_d2_weight_local"], results[0]["mp_d2_weight_local"], rtol=0, atol=0)
        torch.testing.assert_close(r["mp_d1_weight_full"], results[0]["mp_d1_weight_full"], rtol=0, atol=0)
    # Different seeds per rank really would have given different weights.
    torch.manual_seed(101)
    assert not torch.equal(seed_model.SeedModel().d2.weight, results[0]["dp_d2_weight"])


def test_batches_outputs_and_gradients_are_laid_out(results):
    for r in results:
        assert r["batch_is_dtensor"]
        assert r["batch_placements"] == ["S(0)", "R"]
        assert r["batch_global_shape"] == (16, 28, 28, 1) and r["batch_local_shape"] == (8, 28, 28, 1)
        assert r["output_placements"] == ["S(0)", "R"]  # the d2/output layout ("data", None)
        assert r["plain_input_output_placements"] == ["S(0)", "R"]
        # Gradients end on their parameter's placements (reduced over the batch axis).
        assert r["grad_placements"] == r["param_placements"]
        assert r["param_placements"]["d1.weight"] == ["R", "S(0)"]
    # loss.item() is the global loss: equal on all ranks, and the mean of the two data halves.
    items = [r["loss_item"] for r in results]
    assert max(items) - min(items) < 1e-7
    halves = [results[0]["loss_local"], results[2]["loss_local"]]  # ranks 0 and 2 hold different halves
    assert halves[0] != halves[1]
    assert abs(items[0] - sum(halves) / 2) < 1e-6
