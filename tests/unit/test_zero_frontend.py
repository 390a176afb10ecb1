"""ZeRO options on DataParallel / ModelParallel (validated at construction) and shard-unit selection."""

from __future__ import annotations

import pytest
import torch

from trainmesh.distribution import DataParallel, DeviceMesh, LayoutMap, ModelParallel
from trainmesh.distribution.memory_options import MemoryOptions

pytestmark = pytest.mark.timeout(60)

TWO = ["cpu:0", "cpu:1"]


def test_defaults_are_stage_0_without_offload():
    dp = DataParallel(devices=TWO)
    assert dp.zero_stage == 0 and dp.memory == MemoryOptions()


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(zero_stage=4), "zero_stage=4"),
        (dict(zero_stage=True), "zero_stage=True"),
        (dict(zero_stage=3, cpu_offload="yes"), "cpu_offload='yes'"),
        (dict(zero_stage=1, cpu_offload=True), "zero_stage=1, cpu_offload=True"),
        (dict(shard_unit=0), "shard_unit=0"),
        (dict(shard_unit="Block"), "shard_unit='Block'"),
        (dict(reduce_dtype="int8"), "reduce_dtype='int8'"),
    ],
)
def test_bad_options_raise_naming_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        DataParallel(devices=TWO, **bad)
    mesh = DeviceMesh((2,), ["data"], devices=TWO)
    with pytest.raises(ValueError, match=match):
        ModelParallel(layout_map=LayoutMap(mesh), **bad)


def test_reduce_dtype_spellings_and_shard_unit_forms():
    assert DataParallel(devices=TWO, reduce_dtype=torch.bfloat16).memory.reduce_dtype == "bfloat16"
    assert DataParallel(devices=TWO, reduce_dtype="fp32").memory.reduce_dtype == "float32"
    assert DataParallel(devices=TWO, shard_unit=torch.nn.Linear).memory.shard_unit == (torch.nn.Linear,)
    assert DataParallel(devices=TWO, shard_unit=1 << 20).memory.shard_unit == 1 << 20
    assert MemoryOptions(zero_stage=2).replace(zero_stage=None, cpu_offload=True).cpu_offload is True


def test_prepare_optimizer_is_identity_unless_stage_1():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert DataParallel(devices=TWO).prepare_optimizer(optimizer, model) is optimizer
    mesh = DeviceMesh((2,), ["data"], devices=TWO)
    assert ModelParallel(layout_map=LayoutMap(mesh)).prepare_optimizer(optimizer, model) is optimizer


class Block(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)


class WithBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 16)
        self.blocks = torch.nn.ModuleList([Block(), Block(), Block()])


def test_shard_units_default_class_and_size():
    from trainmesh._torch.zero import select_shard_units

    model = WithBlocks()
    units, ordered = select_shard_units(model, None)
    assert units == list(model.blocks) and ordered
    units, _ = select_shard_units(model, (torch.nn.Linear,))
    assert len(units) == 7
    one_linear = (16 * 16 + 16) * 4
    units, _ = select_shard_units(model, one_linear)  # each Block holds two Linears: above, a Linear alone: not
    assert units == list(model.blocks)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert select_shard_units(plain, None)[0] == [plain[0]]  # by size: 1/8 of the model
    assert select_shard_units(plain, 10**9)[0] == []  # the root alone


@pytest.mark.usefixtures("no_process_group_left_behind")
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_meta_device_model_is_materialised_by_its_initialisers(zero_stage):
    # Refused before issue 38; now built in place (tests/multiprocess/test_meta_build.py: every layout).
    import trainmesh as tm

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model = tm.DataParallel(zero_stage=zero_stage).distribute_model(model, init_seed=3)
    tensors = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    assert all(t.device.type == "cpu" and bool(torch.isfinite(t).all()) for t in tensors)
    assert float(tensors[0].detach().abs().max()) > 0  # nn.Linear's reset_parameters ran


def test_blocks_grouped_for_blocking_collectives_up_to_the_bucket():
    from trainmesh._torch.zero import group_for_blocking_collectives

    block_bytes = 2 * (16 * 16 + 16) * 4  # two Linear(16, 16) in fp32
    blocks = [Block() for _ in range(5)]
    # two blocks fit a bucket of 2.5 blocks, a third does not: groups of 2, 2, 1 (the last alone is the module)
    groups = group_for_blocking_collectives(blocks, max_bytes=int(2.5 * block_bytes))
    assert groups == [blocks[0:2], blocks[2:4], blocks[4]]
    # the default bucket (25 MB) takes all five; a bucket smaller than a block leaves each alone
    assert group_for_blocking_collectives(blocks) == [blocks]
    assert group_for_blocking_collectives(blocks, max_bytes=block_bytes - 1) == blocks
    big = Block(width=1024)  # 8 MB: larger than the bucket below, it stays a unit of its own
    assert group_for_blocking_collectives([blocks[0], big, blocks[1]], max_bytes=4 * block_bytes) == [
        blocks[0],
        big,
        blocks[1],
    ]
