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
    out["mesh_too_big"] = _error_of(
        lambda: tm.ModelParallel(layout_map=big_map).distribute_model(seed_model.SeedModel())
    )
    foreign = tm.DeviceMesh((4,), ["batch"], devices=["cpu:0", "cpu:1", "cpu:2", "cpu:7"])
    out["foreign_devices"] = _error_of(
        lambda: tm.DataParallel(device_mesh=foreign).distribute_model(seed_model.SeedModel())
    )
    mesh = tm.DeviceMesh((1, 4), ["data", "model"], devices=tm.list_devices())
    uneven = tm.LayoutMap(mesh)
    uneven["d2.weight"] = ("model", None)  # 10 rows over 4 processes
    out["indivisible_dim"] = _error_of(
        lambda: tm.ModelParallel(layout_map=uneven).distribute_model(seed_model.SeedModel())
    )
    out["indivisible_batch"] = _error_of(lambda: tm.DataParallel().distribute_dataset(data, 6))
    out["not_a_module"] = _error_of(lambda: tm.DataParallel().distribute_model(lambda x: x))

    # --- replicas start identical even when every rank initialised differently ------------
    torch.manual_seed(100 + rank)
    dp_model = tm.DataParallel().distribute_model(seed_model.SeedModel())
    out["dp_d2_weight"] = dp_model.module.d2.weight.detach().clone()
    torch.manual_seed(200 + rank)
    mp = keras_model_parallel.build_distribution((2, 2))
    mp_model = mp.distribute_model(seed_model.SeedModel())
    out["mp_d2_weight"] = mp_model.d2.weight.detach().clone()  # not in the layout map: a plain replica
    out["mp_d1_weight_full"] = mp_model.d1.weight.full_tensor().detach().clone()

    # --- batches are this process's slice; activations and outputs stay local ----------------
    batches = mp.distribute_dataset(data, 16)
    inputs, labels = next(iter(batches))
    out["batch_is_dtensor"] = isinstance(inputs, DTensor)
    out["batch_local_shape"] = tuple(inputs.shape)
    mp_model.eval()  # no dropout: the gradient is compared with one process's below
    output = mp_model(inputs)
    out["output_is_dtensor"] = isinstance(output, DTensor)
    out["output_shape"] = tuple(output.shape)
    loss = torch.nn.functional.mse_loss(output, labels)
    out["loss_item"] = loss.item()  # this process's slice, as under DDP
    loss.backward()
    out["grad_placements"] = {
        n: [str(p) for p in w.grad.placements] for n, w in mp_model.named_parameters() if isinstance(w, DTensor)
    }
    out["param_placements"] = {
        n: [str(p) for p in w.placements] for n, w in mp_model.named_parameters() if isinstance(w, DTensor)
    }
    out["plain_params"] = sorted(n for n, w in mp_model.named_parameters() if not isinstance(w, DTensor))
    out["d2_grad"] = mp_model.d2.weight.grad.detach().clone()
    # The gradient is the full batch's: the same on one process with all 16 rows.
    torch.manual_seed(0)
    reference = seed_model.SeedModel().eval()
    reference.load_state_dict(
        {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in mp_model.state_dict().items()}
    )
    full_x = torch.cat([torch.as_tensor(data[0][:16])])
    torch.nn.functional.mse_loss(reference(full_x), torch.as_tensor(data[1][:16])).backward()
    out["d2_grad_reference"] = reference.d2.weight.grad.detach().clone()

    # --- a global DTensor batch (an older script's) is taken as this process's rows ------------
    from torch.distributed.tensor import Replicate, Shard

    from trainmesh._torch import to_torch_mesh

    torch_mesh = to_torch_mesh(mp.device_mesh)
    global_inputs = DTensor.from_local(inputs, torch_mesh, [Shard(0), Replicate()], run_check=False)
    out["dtensor_input_output_is_local"] = not isinstance(mp_model(global_inputs), DTensor)

    # --- no process-wide change to torch: a plain DTensor program behaves as stock torch -------
    import logging

    from torch.distributed.tensor import Partial

    partial_sum = DTensor.from_local(torch.tensor(float(rank)), torch_mesh, [Partial(), Partial()], run_check=False)
    out["stock_item"] = partial_sum.item()  # stock DTensor: this process's local value, no collective
    out["redistribute_log_level"] = logging.getLogger("torch.distributed.tensor._redistribute").level

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
        torch.testing.assert_close(r["mp_d2_weight"], results[0]["mp_d2_weight"], rtol=0, atol=0)
        torch.testing.assert_close(r["mp_d1_weight_full"], results[0]["mp_d1_weight_full"], rtol=0, atol=0)
    # Different seeds per rank really would have given different weights.
    torch.manual_seed(101)
    assert not torch.equal(seed_model.SeedModel().d2.weight, results[0]["dp_d2_weight"])


def test_batches_are_local_and_gradients_are_the_global_batchs(results):
    for r in results:
        assert not r["batch_is_dtensor"] and r["batch_local_shape"] == (8, 28, 28, 1)
        assert not r["output_is_dtensor"] and r["output_shape"] == (8, 10)
        assert r["dtensor_input_output_is_local"]
        # d1 is column-sharded over "model" (a 1-D sub-mesh); its gradient keeps the placements.
        assert r["param_placements"] == {"d1.weight": ["S(0)"]}
        assert r["grad_placements"] == r["param_placements"]
        assert r["plain_params"] == ["d2.bias", "d2.weight"]
        torch.testing.assert_close(r["d2_grad"], r["d2_grad_reference"], rtol=1e-5, atol=1e-6)
    # Ranks 0 and 2 hold different halves of the batch; their local losses differ.
    assert results[0]["loss_item"] != results[2]["loss_item"]
    assert results[0]["loss_item"] == results[1]["loss_item"]  # one model-axis group, one slice


def test_no_process_wide_changes_to_torch(results):
    """After trainmesh ran in this process, stock DTensor semantics hold: ``.item()`` on a Partial
    DTensor is the local value (a patched one gave the global sum through a hidden collective)
    and torch's loggers keep their levels."""
    for rank, r in enumerate(results):
        assert r["stock_item"] == float(rank)
        assert r["redistribute_log_level"] == 0  # logging.NOTSET: untouched
