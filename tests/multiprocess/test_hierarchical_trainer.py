"""Hierarchical all-reduce in the Trainer, on 4 gloo processes posing as 2 nodes x 2.

``TRAINMESH_HOST_ID`` names each process's host (on real machines the host name and interface
address tell them apart; see trainmesh.comm.topology): two ids make the job two hosts and the
Trainer then reduces gradients inside each host, across hosts, inside again. The result must equal the flat all-reduce (up to summation order), with and without
compression on top.
"""

from __future__ import annotations

import os

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

LR = 0.1  # SGD with momentum 0.9; 8 steps per epoch, 16 in all


def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 10, generator=g)
    return x, torch.sin(x[:, :1]) + 0.1 * x[:, 1:2]


def train(hierarchical, compression=None) -> dict:
    import trainmesh as tm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    first_step = {}
    keep_first_step = tm.LambdaCallback(
        on_train_batch_end=lambda step, logs: (
            first_step
            or first_step.update({k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()})
        )
    )
    trainer = tm.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        torch.nn.MSELoss(),
        hierarchical_allreduce=hierarchical,
        compression=compression,
        callbacks=[keep_first_step],
        progress=False,
    )
    history = trainer.fit(make_data(), epochs=2, batch_size=32)
    return {
        "hierarchical": trainer.communication.hierarchical,
        "losses": [s["loss"] for s in history.steps],
        "params": {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()},
        "first_update": {k: initial[k] - v for k, v in first_step.items()},
    }


def _job() -> dict:
    rank = int(os.environ["RANK"])
    # Two "nodes" of two processes, as torchrun --nnodes 2 --nproc-per-node 2 numbers them.
    os.environ.update(TRAINMESH_HOST_ID=f"node{rank // 2}", LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))
    out = {
        "flat": train(False),
        "forced": train(True),
        "auto": train(None),
        "flat_fp16": train(False, "fp16"),
        "hier_fp16": train(True, "fp16"),
        "flat_powersgd": train(False, "powersgd:1"),
        "hier_powersgd": train(True, "powersgd:1"),
    }
    os.environ.update(TRAINMESH_HOST_ID="node0", LOCAL_WORLD_SIZE="4", LOCAL_RANK=str(rank))  # one node
    out["one_node_auto"] = train(None)["hierarchical"]
    try:
        train(True)
        out["one_node_forced"] = None
    except ValueError as error:
        out["one_node_forced"] = str(error)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_job, world_size=4, timeout=250)


def _close(a: dict, b: dict, tol: float) -> None:
    for name, value in a["params"].items():
        torch.testing.assert_close(b["params"][name], value, rtol=tol, atol=tol)
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=tol, atol=tol)


def _distance(a: dict, b: dict) -> float:
    return max(float((a["params"][name] - value).abs().max()) for name, value in b["params"].items())


# fp32, without compression: the two all-reduces sum the same 4 gradients in another order, which
# changes each average by at most 3 roundings of 2**-24 relative (about 2e-7 of its size). SGD with
# momentum 0.9 carries a step's error into later updates with total weight at most 1/(1 - 0.9) = 10,
# at lr 0.1, so 16 steps part the parameters by at most 16 * 0.1 * 10 * 2e-7 = 3e-6 of the largest
# gradient (these are below 1 here), before the gradients' own response to the difference, which
# plain SGD on this smooth loss does not amplify over 16 steps (measured: 6e-8). Any CPU's order
# stays inside 1e-5; a sum in the wrong units (a host's sum taken as the average) is off by O(lr).
def test_hierarchical_equals_flat_within_1e5(runs):
    for rank in range(4):
        assert runs[rank]["forced"]["hierarchical"] and not runs[rank]["flat"]["hierarchical"]
        _close(runs[rank]["flat"], runs[rank]["forced"], 1e-5)


def test_auto_selects_hierarchical_across_nodes_only(runs):
    for rank in range(4):
        assert runs[rank]["auto"]["hierarchical"] is True
        _close(runs[rank]["flat"], runs[rank]["auto"], 1e-5)
        assert runs[rank]["one_node_auto"] is False


def test_forcing_it_on_one_node_is_a_clear_error(runs):
    message = runs[0]["one_node_forced"]
    assert message is not None and "LOCAL_WORLD_SIZE=4" in message and "WORLD_SIZE=4" in message


def test_fp16_compression_all_reduces_hierarchically_as_close_to_fp32_as_flat(runs):
    # fp16 sums round every partial sum to 11 bits, so the order of the sum decides which roundings
    # happen: the hierarchical run differs from the flat one by about as much as each differs from
    # the uncompressed fp32 run (measured over these 16 steps: 4.6e-4 apart, each 2.5e-4 from fp32).
    # A fixed bound on that would be a reading of one CPU's run. The yardstick is taken in the same
    # run instead: the hierarchical fp16 run stays as close to fp32 as the flat fp16 run does, within
    # 2x (rounding in another order, not more rounding); a wrong scale would be off by O(lr) = 1e-1.
    for rank in range(4):
        exact, flat, hier = (runs[rank][name] for name in ("flat", "flat_fp16", "hier_fp16"))
        floor = _distance(flat, exact)
        assert 0 < floor < 1e-2  # fp16 did round, and no more than half precision does
        assert _distance(hier, exact) <= 2 * floor, (_distance(hier, exact), floor)
        torch.testing.assert_close(torch.tensor(hier["losses"]), torch.tensor(flat["losses"]), rtol=1e-3, atol=0)


def test_powersgd_all_reduces_hierarchically_with_the_same_result(runs):
    for rank in range(4):
        flat, hier = runs[rank]["flat_powersgd"], runs[rank]["hier_powersgd"]
        # Step 1, from the same seeded model: the same arithmetic up to the order of fp32 sums, whose
        # rounding (2**-24 per addition, over sums of at most 32 terms here) the power iteration's QR
        # passes on scaled by P's conditioning, a few units; 1e-4 of the update leaves a margin of
        # 100x over that on any CPU (measured: 1e-7), while an average in the wrong units is off by O(1).
        for name, update in flat["first_update"].items():
            assert float((hier["first_update"][name] - update).norm()) <= 1e-4 * float(update.norm()), name
        # The whole run: PowerSGD amplifies the order's rounding with every step through its power
        # iteration and error feedback (test_powersgd_across_hosts: 2e-8 after 1 step, 1e-6 after 30,
        # 7e-4 after 60), by a factor that depends on the trajectory, not on a bound. So the run is
        # compared on its losses, which that amplification reaches last, at 1e-3 relative (16 steps
        # here moved them 7e-8), and the step above holds the two algorithms to each other exactly
        # where they start from the same state.
        torch.testing.assert_close(torch.tensor(hier["losses"]), torch.tensor(flat["losses"]), rtol=1e-3, atol=0)
