"""Hierarchical all-reduce on 4 gloo processes simulating 2 nodes x 2 processes.

Parity with a flat ``dist.all_reduce`` of the same tensors (several sizes, odd ones included,
SUM/AVG/MAX), with groups from ``node_groups`` and from torch's and trainmesh's DeviceMesh ("node", "local");
and a DDP model trained with ``hierarchical_hook`` equals one trained with default DDP.
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

SIZES = [(1,), (3,), (7,), (1000,), (1001,), (5, 7), (2, 3, 11)]


def _rank_tensor(shape, rank, salt):
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(shape, generator=generator)


def _parity_worker():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainmesh.comm.hierarchical import groups_from_mesh, hierarchical_all_reduce_, node_groups

    rank = dist.get_rank()
    layouts = {"node_groups": node_groups(2, 2)}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    layouts["device_mesh"] = groups_from_mesh(mesh)
    from trainmesh.distribution.mesh import DeviceMesh

    layouts["trainmesh_mesh"] = groups_from_mesh(DeviceMesh((2, 2), ["node", "local"]))
    worst = {}
    for layout, (intra, inter) in layouts.items():
        for op_name in ("SUM", "AVG", "MAX"):
            op = getattr(dist.ReduceOp, op_name)
            for salt, shape in enumerate(SIZES):
                tensor = _rank_tensor(shape, rank, salt)
                expected = tensor.clone()
                dist.all_reduce(expected, op=dist.ReduceOp.SUM if op_name == "AVG" else op)
                if op_name == "AVG":
                    expected /= dist.get_world_size()
                result = hierarchical_all_reduce_(tensor, intra_group=intra, inter_group=inter, op=op)
                assert result is tensor and tensor.shape == torch.Size(shape)
                key = (layout, op_name, shape)
                worst[key] = float((tensor - expected).abs().max())
    # Each group's members, so the test can check that the groups really are nodes.
    intra, inter = layouts["node_groups"]
    members = (dist.get_process_group_ranks(intra), dist.get_process_group_ranks(inter))
    return worst, members


def test_hierarchical_equals_flat_all_reduce():
    results = run_distributed(_parity_worker, world_size=4, timeout=120)
    assert [members for _, members in results] == [
        ([0, 1], [0, 2]),
        ([0, 1], [1, 3]),
        ([2, 3], [0, 2]),
        ([2, 3], [1, 3]),
    ]
    for worst, _ in results:
        assert len(worst) == 3 * 3 * len(SIZES)
        for key, error in worst.items():
            assert error <= 1e-6, (key, error)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # Two buckets (bucket_cap_mb is tiny) with odd sizes: 13*7+7 and 7*3+3 elements.
        self.a = torch.nn.Linear(13, 7)
        self.b = torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _train(hook_state, steps=4):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainmesh.comm.hierarchical import hierarchical_hook

    model = DDP(_Net(), bucket_cap_mb=0.0001)
    if hook_state is not None:
        model.register_comm_hook(hook_state, hierarchical_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(8, 13, generator=generator), torch.randn(8, 3, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ddp_worker():
    from trainmesh.comm.hierarchical import HierarchicalState

    state = HierarchicalState.from_layout(2, 2)
    assert state.world_size == 4
    return _train(None), _train(state)


def test_ddp_with_hierarchical_hook_equals_default_ddp():
    results = run_distributed(_ddp_worker, world_size=4, timeout=120)
    reference = results[0][0]
    initial = torch.cat([p.detach().reshape(-1) for p in _Net().parameters()])
    assert float((reference - initial).abs().max()) > 1e-3  # training moved the parameters
    for default, hierarchical in results:
        torch.testing.assert_close(default, reference, rtol=0, atol=0)  # ranks agree
        torch.testing.assert_close(hierarchical, default, rtol=0, atol=1e-6)


def _bad_input_worker():
    import torch.distributed as dist

    from trainmesh.comm.hierarchical import hierarchical_all_reduce_, node_groups

    intra, inter = node_groups(1, 2)
    errors = []
    for call in (
        lambda: node_groups(2, 2),
        lambda: hierarchical_all_reduce_([1.0], intra_group=intra, inter_group=inter),
        lambda: hierarchical_all_reduce_(torch.ones(2), intra_group=intra, inter_group=inter, op="sum"),
        lambda: hierarchical_all_reduce_(torch.ones(2), intra_group=None, inter_group=inter),
    ):
        try:
            call()
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    dist.barrier()
    return errors


def test_bad_input_raises_before_any_collective():
    errors = run_distributed(_bad_input_worker, world_size=2, timeout=60)[0]
    assert len(errors) == 4
    assert "world size 2" in errors[0] and "nnodes=2" in errors[0]
    assert "list" in errors[1]
    assert "op=" in errors[2]
    assert "intra_group" in errors[3]
