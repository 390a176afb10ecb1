"""MirroredStrategy on real gloo groups of 2 and 4 processes.

One launch per world size checks everything (process start-up dominates): each scenario
records what happened on every rank, the parent compares across ranks and against plain
torch on one process, and a last all-reduce proves no scenario left a rank stuck.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

from trainmesh.testing import run_distributed

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples")))

import strategy_custom_loop  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

# (global batch, samples) of the uneven parity run: not divisible by 2 or 4 replicas.
UNEVEN = {2: (101, 606), 4: (102, 612)}


class WithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("noise", torch.randn(3))


def _error_of(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "no error"


def _scenarios() -> dict:
    import torch.distributed as dist
    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as torch_optimizer

    import trainmesh as tm
    from trainmesh.strategy import MirroredStrategy, MultiWorkerMirroredStrategy, ReduceOp

    rank, world = tm.rank(), tm.world_size()
    step_hooks_before = len(torch_optimizer._global_optimizer_pre_hooks)
    out: dict = {}
    strategy = MirroredStrategy()
    out["replicas"] = (
        strategy.num_replicas_in_sync,
        strategy.replica_id_in_sync_group,
        MultiWorkerMirroredStrategy().num_replicas_in_sync,
    )

    # --- mirrored init: identical on every replica although every rank seeds differently ----
    torch.manual_seed(100 + rank)
    with strategy.scope():
        model = WithBuffer()
    out["init"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["unmirrored"] = torch.nn.Linear(4, 3).weight.detach().clone()  # built outside: differs

    # --- optimizer.step() SUMs mirrored gradients; None on some replicas counts as zero --------
    with strategy.scope():
        a, b, c = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
        holder = torch.nn.Module()
        holder.a, holder.b, holder.c = a, b, c
    a.grad = torch.full((3,), float(rank + 1))
    b.grad = torch.ones(3) if rank == world - 1 else None  # only the last replica has one
    torch.optim.SGD([a, b, c], lr=1.0).step()
    out["summed_step"] = (a.detach().clone(), b.detach().clone(), c.grad is None, b.grad.clone())

    # --- aggregate_gradients: reduce now (to clip), the step does not reduce again --------------
    a.grad = torch.full((3,), float(rank + 1))
    optimizer = torch.optim.SGD([a], lr=1.0)
    strategy.aggregate_gradients(optimizer)
    out["aggregated_grad"] = a.grad.clone()
    optimizer.step()
    out["after_aggregated_step"] = a.detach().clone()

    # --- wrapped in DDP (the Trainer's way): gradients averaged once, not summed on top -------
    for wrap in (strategy.distribution.distribute_model, torch.nn.parallel.DistributedDataParallel):
        with strategy.scope():
            net = torch.nn.Linear(4, 1)
        before = net.weight.detach().clone()
        x = torch.full((2, 4), float(rank + 1))
        local = torch.autograd.grad(net(x).pow(2).mean(), net.weight)[0]
        wrapped = wrap(net)  # keep it alive through backward: its reducer does the all-reduce
        wrapped(x).pow(2).mean().backward()
        torch.optim.SGD(net.parameters(), lr=0.1).step()
        out.setdefault("ddp", []).append(
            (net.weight.grad.clone(), strategy.reduce(ReduceOp.MEAN, local), before, net.weight.detach().clone())
        )

    # --- the custom loop of the example (even and uneven global batches) ----------------------
    out["loop"] = strategy_custom_loop.train(strategy, epochs=2)["weights"]
    gbs, samples = UNEVEN[world]
    out["loop_uneven"] = strategy_custom_loop.train(strategy, epochs=2, global_batch_size=gbs, num_samples=samples)[
        "weights"
    ]

    # --- reduce ---------------------------------------------------------------------------------
    same_shape = torch.tensor([rank + 1.0, 10.0])
    rows = torch.full((rank + 1, 2), float(rank + 1))  # uneven: rank r holds r + 1 rows
    out["reduce"] = {
        "sum": strategy.reduce(ReduceOp.SUM, same_shape),
        "mean": strategy.reduce(ReduceOp.MEAN, same_shape),
        "sum_axis0": strategy.reduce(ReduceOp.SUM, rows, axis=0),
        "mean_axis0": strategy.reduce(ReduceOp.MEAN, rows, axis=0),
        "mean_axis_last": strategy.reduce("mean", rows.T, axis=-1),
        "mean_empty_on_rank0": strategy.reduce("mean", torch.ones(rank, 2) * rank, axis=0),
        "int_mean": strategy.reduce("mean", torch.tensor(rank)),
        "nest": strategy.reduce("sum", {"n": 1, "t": (torch.ones(2),)}),
    }

    # --- gather (uneven sizes, a replica with nothing, a mismatch raising everywhere) ------------
    out["gather"] = {
        "axis0": strategy.gather(torch.full((rank + 1, 3), rank), axis=0),
        "axis1": strategy.gather(torch.full((2, rank + 1), float(rank)), axis=1),
        "empty_rank0": strategy.gather(torch.arange(rank), axis=0),
        "mismatch": _error_of(lambda: strategy.gather(torch.zeros(2, rank + 1), axis=0)),
    }

    # --- input ---------------------------------------------------------------------------------
    global_batches = [(torch.arange(7), {"y": torch.arange(7) * 10}), (torch.arange(7, 10), {"y": torch.zeros(3)})]
    distributed = strategy.experimental_distribute_dataset(global_batches)
    out["slices"] = [(ids.tolist(), d["y"].tolist()) for ids, d in distributed]

    def dataset_fn(ctx):
        size = ctx.get_per_replica_batch_size(4 * ctx.num_replicas_in_sync)
        return [torch.full((size,), ctx.input_pipeline_id)]

    out["from_function"] = [t.tolist() for t in strategy.distribute_datasets_from_function(dataset_fn)]

    # --- scope: restored on an exception, nothing from the failed block mirrored ----------------
    param_hooks = len(torch_module._global_parameter_registration_hooks)
    failed = []
    try:
        with strategy.scope():
            failed.append(torch.nn.Linear(2, 2))
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    out["after_exception"] = (
        tm.distribution() is None,
        len(torch_module._global_parameter_registration_hooks) == param_hooks,
        strategy._mirror.is_mirrored(failed[0].weight),
    )

    # --- lifetime: close() removes the step hook; a strategy whose parameters died drops its own -
    hooks_with_strategy = len(torch_optimizer._global_optimizer_pre_hooks)
    strategy.close()
    a.grad = torch.full((3,), float(rank + 1))
    torch.optim.SGD([a], lr=0.0).step()
    out["closed"] = (hooks_with_strategy, len(torch_optimizer._global_optimizer_pre_hooks), a.grad.clone())
    short_lived = MirroredStrategy()
    with short_lived.scope():
        temporary = torch.nn.Linear(2, 2)
    installed = short_lived._mirror.step_hook_installed
    del temporary
    gc.collect()
    plain = torch.nn.Parameter(torch.zeros(1))
    plain.grad = torch.ones(1)
    torch.optim.SGD([plain], lr=0.1).step()
    out["self_removed"] = (
        installed,
        short_lived._mirror.step_hook_installed,
        len(torch_optimizer._global_optimizer_pre_hooks) == step_hooks_before,
    )

    check = torch.ones(1)
    dist.all_reduce(check)
    out["alive"] = check.item()
    return out


def reference_loop(global_batch_size: int, num_samples: int, epochs: int = 2) -> dict:
    """Plain torch on one process, the same global batches, a mean loss per global batch."""
    ex = strategy_custom_loop
    model = ex.make_model(0)
    optimizer = ex.make_optimizer(model.parameters())
    loader = ex.make_loader(ex.make_data(num_samples, 0), global_batch_size, seed=0)
    for _ in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.state_dict()


def assert_same_weights(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        # rtol 1e-5 in fp32; atol covers weights near zero (observed differences ~3e-8).
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("world", [2, 4])
def test_mirrored_strategy(world):
    results = run_distributed(_scenarios, world_size=world, timeout=170)
    n = world
    first = results[0]
    assert [r["replicas"] for r in results] == [(n, i, n) for i in range(n)]

    for r in results[1:]:  # mirrored: every replica equal to replica 0, parameters and buffers
        for name, value in first["init"].items():
            assert torch.equal(r["init"][name], value), name
    assert not torch.equal(results[1]["unmirrored"], first["unmirrored"])

    total = n * (n + 1) / 2
    for r in results:
        a, b, c_grad_is_none, b_grad = r["summed_step"]
        assert torch.equal(a, torch.full((3,), -total))  # SUM of 1..n, lr 1
        assert torch.equal(b, -torch.ones(3)) and torch.equal(b_grad, torch.ones(3))
        assert c_grad_is_none  # no replica had one: untouched
        assert torch.equal(r["aggregated_grad"], torch.full((3,), total))
        assert torch.equal(r["after_aggregated_step"], torch.full((3,), -2 * total))  # reduced once
        for ddp_grad, mean_of_local, before, after in r["ddp"]:  # distribute_model, then DDP by hand
            torch.testing.assert_close(ddp_grad, mean_of_local)  # DDP averaged; the step did not sum again
            torch.testing.assert_close(after, before - 0.1 * mean_of_local)

    expected = reference_loop(64 * n, strategy_custom_loop.NUM_SAMPLES)
    gbs, samples = UNEVEN[n]
    expected_uneven = reference_loop(gbs, samples)
    for r in results:
        assert_same_weights(r["loop"], expected)
        assert_same_weights(r["loop_uneven"], expected_uneven)

    squares = sum((i + 1) ** 2 for i in range(n))
    count = sum(i + 1 for i in range(n))
    for r in results:
        red = r["reduce"]
        assert red["sum"].tolist() == [total, 10.0 * n]
        assert red["mean"].tolist() == pytest.approx([total / n, 10.0])
        assert red["sum_axis0"].tolist() == [squares, squares]
        assert red["mean_axis0"].tolist() == pytest.approx([squares / count] * 2)
        assert red["mean_axis_last"].tolist() == pytest.approx([squares / count] * 2)
        empty_ok = sum(i * i for i in range(n)) / sum(range(n))
        assert red["mean_empty_on_rank0"].tolist() == pytest.approx([empty_ok] * 2)
        assert red["int_mean"].item() == pytest.approx((n - 1) / 2)
        assert red["nest"]["n"].item() == n and red["nest"]["t"][0].tolist() == [n, n]

        gat = r["gather"]
        assert gat["axis0"][:, 0].tolist() == [i for i in range(n) for _ in range(i + 1)]
        assert gat["axis1"][0].tolist() == [float(i) for i in range(n) for _ in range(i + 1)]
        assert gat["empty_rank0"].tolist() == [v for i in range(n) for v in range(i)]
        assert gat["mismatch"].startswith("ValueError") and "Received" in gat["mismatch"]

    sizes = [[len(ids) for ids, _ in r["slices"]] for r in results]
    tf_sizes = [[7 // n + (i < 7 % n), 3 // n + (i < 3 % n)] for i in range(n)]
    assert sizes == tf_sizes  # the first B % N replicas get one more
    for step, global_ids in enumerate([list(range(7)), list(range(7, 10))]):
        assert [i for r in results for i in r["slices"][step][0]] == global_ids  # contiguous, in order
    assert [i for r in results for i in r["slices"][0][1]] == [10 * i for i in range(7)]
    assert [r["from_function"] for r in results] == [[[i] * 4] for i in range(n)]  # one pipeline per replica

    for r in results:
        assert r["after_exception"] == (True, True, False)
        hooks_with_strategy, hooks_after_close, local_grad = r["closed"]
        assert hooks_after_close == hooks_with_strategy - 1
        installed, still_installed, back_to_baseline = r["self_removed"]
        assert installed and not still_installed and back_to_baseline
        assert r["alive"] == n
    assert [r["closed"][2].tolist() for r in results] == [[float(i + 1)] * 3 for i in range(n)]  # not reduced
