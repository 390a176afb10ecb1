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


def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 10, generator=g)
    return x, torch.sin(x[:, :1]) + 0.1 * x[:, 1:2]


def train(hierarchical, compression=None) -> dict:
    import trainmesh as tm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    trainer = tm.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.nn.MSELoss(),
                         hierarchical_allreduce=hierarchical, compression=compression, progress=False)
    history = trainer.fit(make_data(), epochs=2, batch_size=32)
    return {"hierarchical": trainer.communication.hierarchical, "losses": [s["loss"] for s in history.steps],
            "params": {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}}


def _job() -> dict:
    rank = int(os.environ["RANK"])
    # Two "nodes" of two processes, as torchrun --nnodes 2 --nproc-per-node 2 numbers them.
    os.environ.update(TRAINMESH_HOST_ID=f"node{rank // 2}", LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))
    out = {"flat": train(False), "forced": train(True), "auto": train(None),
           "flat_fp16": train(False, "fp16"), "hier_fp16": train(True, "fp16"),
           "flat_powersgd": train(False, "powersgd:1"), "hier_powersgd": train(True, "powersgd:1")}
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


@pytest.mark.parametrize("spec", ["fp16", "powersgd"])
def test_compression_all_reduces_hierarchically_with_the_same_result(runs, spec):
    for rank in range(4):
        # fp16 sums in half precision: a different summation order rounds differently.
        _close(runs[rank][f"flat_{spec}"], runs[rank][f"hier_{spec}"], 1e-3 if spec == "fp16" else 1e-5)
