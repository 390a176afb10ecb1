"""trainmesh.strategy on one process, no process group: InputContext, ReduceOp,
compute_average_loss, the slicing of global batches, and a one-replica MirroredStrategy."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer

import trainmesh as tm
from trainmesh.distribution import distribution
from trainmesh.strategy import InputContext, MirroredStrategy, ReduceOp, compute_average_loss
from trainmesh.strategy.input import DistributedDataset, replica_bounds, slice_for_replica
from trainmesh.strategy.reduce import gather_across_replicas, reduce_across_replicas

pytestmark = [pytest.mark.timeout(60)]


# --- InputContext ------------------------------------------------------------------------
def test_input_context_properties_and_per_replica_batch():
    ctx = InputContext(num_input_pipelines=4, input_pipeline_id=3, num_replicas_in_sync=8)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (4, 3, 8)
    assert ctx.get_per_replica_batch_size(64) == 8
    assert InputContext().get_per_replica_batch_size(5) == 5
    assert "input_pipeline_id=3" in repr(ctx)


@pytest.mark.parametrize("global_batch_size", [63, 0, -8, 64.0, True])
def test_input_context_rejects_indivisible_global_batch(global_batch_size):
    with pytest.raises(ValueError, match="Received: global_batch_size="):
        InputContext(num_replicas_in_sync=8).get_per_replica_batch_size(global_batch_size)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_input_pipelines": 0},
        {"input_pipeline_id": -1},
        {"num_replicas_in_sync": 0},
        {"num_input_pipelines": 2, "input_pipeline_id": 2},
        {"num_replicas_in_sync": 2.0},
    ],
)
def test_input_context_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="Received"):
        InputContext(**kwargs)


# --- ReduceOp ----------------------------------------------------------------------------
def test_reduce_op_values_and_parsing():
    assert [op.value for op in ReduceOp] == ["SUM", "MEAN"]
    assert ReduceOp.from_value("sum") is ReduceOp.SUM
    assert ReduceOp.from_value(ReduceOp.MEAN) is ReduceOp.MEAN
    with pytest.raises(ValueError, match="Received: reduce_op='max'"):
        ReduceOp.from_value("max")


# --- compute_average_loss ----------------------------------------------------------------
def test_compute_average_loss_divides_the_sum_by_the_global_batch():
    per_example = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert compute_average_loss(per_example, global_batch_size=8).item() == pytest.approx(1.5)
    assert compute_average_loss(per_example, global_batch_size=np.int64(4)).item() == pytest.approx(3.0)
    weighted = compute_average_loss(per_example, global_batch_size=4, sample_weight=[1.0, 0.0, 0.0, 0.5])
    assert weighted.item() == pytest.approx(1.0)
    assert compute_average_loss(torch.ones(2, 3), global_batch_size=2).item() == pytest.approx(3.0)  # sums all
    assert compute_average_loss(torch.tensor([2, 4])).dtype == torch.get_default_dtype()


def test_compute_average_loss_default_uses_the_replicas_in_scope():
    per_example = torch.tensor([1.0, 3.0])
    assert compute_average_loss(per_example).item() == pytest.approx(2.0)  # one replica outside any scope
    with tm.DataParallel(devices=["cpu:0", "cpu:1"]).scope():  # metadata only: 2 replicas
        assert compute_average_loss(per_example).item() == pytest.approx(1.0)


def test_compute_average_loss_zero_global_batch_is_zero_and_differentiable():
    per_example = torch.ones(0, requires_grad=True)
    loss = compute_average_loss(per_example, global_batch_size=0)
    loss.backward()
    assert loss.item() == 0.0 and per_example.grad is not None


@pytest.mark.parametrize("bad", [-1, 2.5, True, "8"])
def test_compute_average_loss_rejects_bad_global_batch(bad):
    with pytest.raises(ValueError, match="Received: global_batch_size="):
        compute_average_loss(torch.ones(2), global_batch_size=bad)


def test_compute_average_loss_needs_a_batch_dim():
    with pytest.raises(ValueError, match="batch dim"):
        compute_average_loss(torch.tensor(1.0), global_batch_size=1)
    with pytest.raises(ValueError, match="must be a tensor"):
        compute_average_loss([1.0, 2.0], global_batch_size=2)


# --- slicing global batches ----------------------------------------------------------------
def tf_batch_sizes(global_batch_size: int, num_replicas: int) -> list[int]:
    """TF's batch_sizes_for_worker for one worker: the first B % N replicas get one more."""
    floor, num_ceil = divmod(global_batch_size, num_replicas)
    return [floor + 1] * num_ceil + [floor] * (num_replicas - num_ceil)


@pytest.mark.parametrize("batch,replicas", [(8, 2), (7, 4), (3, 4), (0, 3), (10, 3), (1, 1), (5, 8)])
def test_replica_bounds_split_as_evenly_as_possible_and_contiguously(batch, replicas):
    bounds = [replica_bounds(batch, replicas, i) for i in range(replicas)]
    assert [stop - start for start, stop in bounds] == tf_batch_sizes(batch, replicas)
    assert bounds[0][0] == 0 and bounds[-1][1] == batch
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(replicas - 1))


def test_replica_bounds_rejects_bad_placement():
    with pytest.raises(ValueError, match="Received"):
        replica_bounds(8, 2, 2)


Pair = collections.namedtuple("Pair", ["x", "y"])


def test_slice_for_replica_keeps_structure_and_concatenates_back():
    ids = torch.arange(7)
    batch = (ids, {"y": ids * 10, "meta": "tag"}, [np.arange(7.0)], Pair(ids, ids))
    parts = [slice_for_replica(batch, 3, i) for i in range(3)]
    assert [len(p[0]) for p in parts] == [3, 2, 2]
    assert torch.equal(torch.cat([p[0] for p in parts]), ids)
    assert torch.equal(torch.cat([p[1]["y"] for p in parts]), ids * 10)
    assert all(p[1]["meta"] == "tag" for p in parts)  # non-tensor leaves pass unchanged
    assert np.array_equal(np.concatenate([p[2][0] for p in parts]), np.arange(7.0))
    assert isinstance(parts[1][3], Pair) and parts[1][3].x.tolist() == [3, 4]


def test_slice_for_replica_rejects_mismatched_batch_dims():
    with pytest.raises(ValueError, match="same first"):
        slice_for_replica((torch.zeros(4), torch.zeros(5)), 2, 0)


def test_distributed_dataset_iterates_slices_and_calls_on_iter():
    calls = []
    batches = [(torch.arange(6),), (torch.arange(6, 9),)]  # a full global batch, then a partial one
    dataset = DistributedDataset(batches, num_replicas=4, replica_id=3, on_iter=lambda: calls.append(1))
    assert len(dataset) == 2
    assert [b[0].tolist() for b in dataset] == [[5], []]  # 6 -> [2,2,1,1], 3 -> [1,1,1,0]
    assert calls == [1]
    with pytest.raises(ValueError, match="iterable"):
        DistributedDataset(42, num_replicas=1, replica_id=0)


# --- reduce and gather with one replica ------------------------------------------------------
def test_reduce_with_one_replica_follows_tf_semantics():
    value = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    summed = reduce_across_replicas(ReduceOp.SUM, value, None, 1)
    assert torch.equal(summed, value) and summed is not value
    summed.add_(1)
    assert value[0, 0] == 1.0  # never the caller's tensor
    assert reduce_across_replicas("mean", value, 0, 1).tolist() == [3.0, 4.0]
    assert reduce_across_replicas("sum", value, -1, 1).tolist() == [3.0, 7.0, 11.0]
    assert reduce_across_replicas("mean", torch.tensor([1, 2]), 0, 1).item() == pytest.approx(1.5)
    nested = reduce_across_replicas("sum", {"a": 2.0, "b": (torch.ones(2),)}, None, 1)
    assert nested["a"].item() == 2.0 and nested["b"][0].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="Received: axis=2"):
        reduce_across_replicas("sum", value, 2, 1)
    with pytest.raises(ValueError, match="scalar"):
        reduce_across_replicas("sum", torch.tensor(1.0), 0, 1)
    with pytest.raises(ValueError, match="Received: value="):
        reduce_across_replicas("sum", "text", None, 1)
    assert torch.equal(gather_across_replicas(value, 1, [0]), value)


# --- a one-replica MirroredStrategy (no process group) -----------------------------------------
def test_strategy_on_one_process():
    strategy = MirroredStrategy()
    assert strategy.num_replicas_in_sync == 1 and strategy.replica_id_in_sync_group == 0
    assert isinstance(strategy.distribution, tm.DataParallel)
    assert MirroredStrategy(devices=["/CPU:0"]).num_replicas_in_sync == 1  # TF spelling accepted
    assert strategy.experimental_local_results(3) == (3,)
    seen = {}

    def step(x, scale=1.0):
        seen["distribution"] = distribution()
        return compute_average_loss(x) * scale

    assert strategy.run(step, args=(torch.tensor([2.0, 4.0]),), kwargs={"scale": 2.0}).item() == 6.0
    assert seen["distribution"] is strategy.distribution and distribution() is None
    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        return [(torch.ones(context.get_per_replica_batch_size(2)),)]

    data = strategy.distribute_datasets_from_function(dataset_fn)
    assert [b[0].tolist() for b in data] == [[1.0, 1.0]]
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts] == [(1, 0, 1)]
    assert [b.tolist() for b in strategy.experimental_distribute_dataset([torch.arange(3)])] == [[0, 1, 2]]


@pytest.mark.parametrize("devices", [["cpu:0", "cpu:1"], ["cpu:1"], "cpu:0", ["tpu"]])
def test_strategy_rejects_devices_that_are_not_the_job(devices):
    with pytest.raises(ValueError, match="Received"):
        MirroredStrategy(devices=devices)


def test_scope_mirrors_modules_built_inside_and_restores_state():
    strategy = MirroredStrategy()
    param_hooks = len(torch_module._global_parameter_registration_hooks)
    step_hooks = len(torch_optimizer._global_optimizer_pre_hooks)
    outside = torch.nn.Linear(2, 2)
    with strategy.scope() as entered:
        assert entered is strategy and distribution() is strategy.distribution
        assert len(torch_module._global_parameter_registration_hooks) == param_hooks + 1
        inside = torch.nn.Linear(2, 2)
        with strategy.scope():  # the same strategy nests
            nested = torch.nn.Linear(2, 2)
    assert distribution() is None
    assert len(torch_module._global_parameter_registration_hooks) == param_hooks
    assert len(torch_optimizer._global_optimizer_pre_hooks) == step_hooks  # one replica: no step hook
    assert all(strategy._mirror.is_mirrored(p) for p in [*inside.parameters(), *nested.parameters()])
    assert not any(strategy._mirror.is_mirrored(p) for p in outside.parameters())
    strategy.close()
    assert not strategy._mirror.is_mirrored(inside.weight)


def test_scope_restores_on_exception_and_mirrors_nothing_from_the_failed_block():
    strategy, other = MirroredStrategy(), MirroredStrategy()
    param_hooks = len(torch_module._global_parameter_registration_hooks)
    previous = tm.DataParallel(devices=["cpu:0"])
    tm.set_distribution(previous)
    try:
        failed = []
        with pytest.raises(RuntimeError, match="boom"):
            with strategy.scope():
                failed.append(torch.nn.Linear(2, 2))
                raise RuntimeError("boom")
        assert distribution() is previous
        assert len(torch_module._global_parameter_registration_hooks) == param_hooks
        assert not strategy._mirror.is_mirrored(failed[0].weight) and strategy._mirror.num_pending == 0
        with strategy.scope():
            with pytest.raises(ValueError, match="Mixing different strategies"):
                with other.scope():
                    pass
            assert distribution() is strategy.distribution
        assert distribution() is previous
    finally:
        tm.set_distribution(None)


# --- flat buffers for the collectives --------------------------------------------------------
def test_buckets_group_by_dtype_keep_order_and_respect_the_cap():
    from trainmesh.strategy.buckets import buckets

    a, b, c = torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(2)
    big = torch.zeros(300)  # 1200 bytes: alone in its bucket under a 1 KiB cap
    assert [[id(t) for t in bucket] for bucket in buckets([a, b, c], 1 << 20)] == [[id(a), id(c)], [id(b)]]
    assert [len(bucket) for bucket in buckets([a, big, c, a], 1024)] == [1, 1, 2]
