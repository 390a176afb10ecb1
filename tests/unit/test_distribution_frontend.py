"""Distribution, DataParallel, ModelParallel and the global distribution state (pure metadata)."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

import trainmesh
from trainmesh.distribution import (
    DataParallel,
    DeviceMesh,
    Distribution,
    LayoutMap,
    ModelParallel,
    TensorLayout,
    distribution,
    set_distribution,
)
from trainmesh.distribution.dataset import DistributedBatches
from trainmesh.runtime import process_group

pytestmark = pytest.mark.timeout(60)

EIGHT = [f"cpu:{i}" for i in range(8)]


@pytest.fixture(autouse=True)
def single_process_and_clean_state(monkeypatch):
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TF_CONFIG") or name.startswith(
            ("TRAINMESH_", "SLURM_")
        ):
            monkeypatch.delenv(name)
    monkeypatch.setattr(process_group, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    set_distribution(None)
    yield
    set_distribution(None)


@pytest.fixture
def mesh24():
    return DeviceMesh((2, 4), ["data", "model"], devices=EIGHT)


@pytest.fixture
def layout_map(mesh24):
    lm = LayoutMap(mesh24)
    lm["d1.weight"] = ("model", None)  # torch Linear weight is (out, in)
    lm["d1.bias"] = ("model",)
    lm["d2.weight"] = (None, "model")
    lm["d2/output"] = ("data", None)
    return lm


# --- Distribution (abstract) ------------------------------------------------------------------


def test_distribution_is_abstract(mesh24):
    with pytest.raises(TypeError):
        Distribution(mesh24)


def test_minimal_subclass_gets_base_behaviour(mesh24):
    class Replicate(Distribution):
        def get_variable_layout(self, variable):
            return TensorLayout((None,) * len(variable[1].shape), self.device_mesh)

        def distribute_model(self, model):
            return model

    d = Replicate(mesh24, batch_dim_name="model")
    assert d.data_parallel_size == 4
    assert d.get_tensor_layout("x/output") is None
    assert d.get_data_layout((8, 3)).axes == ("model", None)
    assert Replicate(mesh24).data_parallel_size == 1  # no batch axis: nothing is split
    assert Replicate(mesh24).get_data_layout((3, 2)).axes == (None, None)
    with pytest.raises(ValueError, match="batch_dim_name"):
        Replicate(mesh24, batch_dim_name="batch")
    with pytest.raises(ValueError):
        Replicate("not a mesh")


# --- DataParallel ------------------------------------------------------------------------------


def test_data_parallel_default_mesh_single_process():
    dp = DataParallel()
    assert dp.device_mesh.shape == (1,)
    assert dp.device_mesh.axis_names == ["batch"]
    assert dp.device_mesh.devices.tolist() == ["cpu:0"]
    assert dp.batch_dim_name == "batch"
    assert dp.auto_shard_dataset is True
    assert dp.data_parallel_size == 1


def test_data_parallel_default_mesh_spans_the_detected_job(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    dp = DataParallel()
    assert dp.device_mesh.shape == (4,)
    assert dp.data_index() == 2


def test_data_parallel_devices():
    dp = DataParallel(devices=EIGHT)
    assert dp.device_mesh.shape == (8,) and dp.device_mesh.axis_names == ["batch"]
    assert dp.device_mesh.devices.tolist() == EIGHT
    assert dp.data_parallel_size == 8


def test_data_parallel_with_mesh_uses_first_axis(mesh24):
    dp = DataParallel(device_mesh=mesh24, auto_shard_dataset=False)
    assert dp.device_mesh is mesh24
    assert dp.batch_dim_name == "data"
    assert dp.data_parallel_size == 2
    assert dp.auto_shard_dataset is False
    dp.auto_shard_dataset = True
    assert dp.auto_shard_dataset is True


def test_data_parallel_mesh_and_devices_is_error(mesh24):
    with pytest.raises(ValueError, match="not both"):
        DataParallel(device_mesh=mesh24, devices=EIGHT)


@pytest.mark.parametrize("kwargs", [{"devices": []}, {"device_mesh": "mesh"}, {"devices": ["cpu:0", "cpu:0"]}])
def test_data_parallel_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        DataParallel(**kwargs)


def test_data_parallel_data_layout():
    dp = DataParallel(devices=EIGHT)
    layout = dp.get_data_layout((16, 28, 28, 1))
    assert layout.axes == ("batch", None, None, None)
    assert layout.device_mesh is dp.device_mesh
    assert dp.get_data_layout([8]).axes == ("batch",)


@pytest.mark.parametrize("batch", [12, 4, 0, -8])
def test_global_batch_not_divisible_by_data_axis(batch):
    dp = DataParallel(devices=EIGHT)
    with pytest.raises(ValueError, match="global_batch_size"):
        dp.get_data_layout((batch, 28, 28, 1))
    with pytest.raises(ValueError, match="global_batch_size"):
        dp.validate_global_batch(batch)


def test_validate_global_batch_accepts_multiples(mesh24):
    dp = DataParallel(device_mesh=mesh24)  # batch axis "data" of size 2
    for batch in (2, 4, 6, 64):
        dp.validate_global_batch(batch)
    with pytest.raises(ValueError):
        dp.validate_global_batch(3)


def test_data_layout_needs_a_batch_dim():
    with pytest.raises(ValueError):
        DataParallel(devices=EIGHT).get_data_layout(())


def test_data_parallel_variable_layout_is_replicated():
    dp = DataParallel(devices=EIGHT)
    layout = dp.get_variable_layout(("w", torch.zeros(3, 4)))
    assert layout.axes == (None, None)
    assert layout.device_mesh is dp.device_mesh
    assert dp.get_variable_layout(("b", torch.zeros(5))).axes == (None,)
    keras_like = SimpleNamespace(path="dense/kernel", shape=(2, 3, 4))
    assert dp.get_variable_layout(keras_like).axes == (None, None, None)
    with pytest.raises(TypeError):
        dp.get_variable_layout(torch.zeros(3))


def test_data_index_per_rank(mesh24):
    dp = DataParallel(devices=EIGHT)
    assert [dp.data_index(r) for r in range(8)] == list(range(8))
    assert dp.data_index() == 0  # this (single, uninitialized) process is rank 0
    dp2 = DataParallel(device_mesh=mesh24)
    assert [dp2.data_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError):
        dp2.data_index(8)


def test_distribute_dataset_on_logical_mesh():
    """DataParallel.distribute_dataset is metadata + slicing: rank 0 of 8 logical replicas."""
    dp = DataParallel(devices=EIGHT)
    data = torch.arange(32)
    batches = dp.distribute_dataset(data, 16)
    assert isinstance(batches, DistributedBatches)
    assert [b[0].tolist() for b in batches] == [[0, 1], [16, 17]]
    with pytest.raises(ValueError):
        dp.distribute_dataset(data, 12)
    dp.auto_shard_dataset = False
    assert [b[0].tolist() for b in dp.distribute_dataset(data, 16)] == [list(range(16)), list(range(16, 32))]


# --- ModelParallel -----------------------------------------------------------------------------


def test_model_parallel_mesh_and_batch_axis(layout_map, mesh24):
    mp = ModelParallel(layout_map=layout_map)
    assert mp.device_mesh is mesh24
    assert mp.layout_map is layout_map
    assert mp.batch_dim_name == "data"
    assert mp.data_parallel_size == 2
    assert mp.auto_shard_dataset is True
    mp2 = ModelParallel(layout_map=layout_map, batch_dim_name="model", auto_shard_dataset=False)
    assert mp2.batch_dim_name == "model" and mp2.data_parallel_size == 4
    assert mp2.auto_shard_dataset is False


def test_model_parallel_batch_dim_not_in_mesh(layout_map):
    with pytest.raises(ValueError, match="batch"):
        ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def test_model_parallel_needs_a_layout_map_with_a_mesh(layout_map):
    with pytest.raises(TypeError):
        ModelParallel(layout_map)  # keyword-only, as in Keras
    with pytest.raises(ValueError):
        ModelParallel(layout_map=None)
    with pytest.raises(ValueError):
        ModelParallel(layout_map={"d1.weight": ("model", None)})
    with pytest.raises(ValueError, match="device mesh"):
        ModelParallel(layout_map=LayoutMap())


def test_model_parallel_variable_layouts_for_a_torch_model(layout_map):
    model = torch.nn.Sequential()
    model.add_module("d1", torch.nn.Linear(784, 200))
    model.add_module("d2", torch.nn.Linear(200, 8))
    mp = ModelParallel(layout_map=layout_map)
    layouts = {name: mp.get_variable_layout((name, p)).axes for name, p in model.named_parameters()}
    assert layouts == {
        "d1.weight": ("model", None),  # (out=200, in=784): out split over 4
        "d1.bias": ("model",),
        "d2.weight": (None, "model"),  # (8, 200): in split over 4
        "d2.bias": (None,),  # unmatched: replicated
    }
    assert mp.get_variable_layout(("d2.bias", model.d2.bias)).device_mesh is mp.device_mesh


def test_model_parallel_regex_keys(mesh24):
    lm = LayoutMap(mesh24)
    lm[r"blocks\.\d+\.fc\.weight"] = ("model", None)
    mp = ModelParallel(layout_map=lm)
    assert mp.get_variable_layout(("blocks.3.fc.weight", torch.zeros(8, 2))).axes == ("model", None)
    assert mp.get_variable_layout(("blocks.3.fc.bias", torch.zeros(8))).axes == (None,)


def test_model_parallel_non_divisible_dim(layout_map):
    mp = ModelParallel(layout_map=layout_map)
    with pytest.raises(ValueError, match=r"d1\.weight"):
        mp.get_variable_layout(("d1.weight", torch.zeros(10, 784)))  # 10 % 4 != 0
    with pytest.raises(ValueError, match=r"d1\.weight"):
        mp.get_variable_layout(("d1.weight", torch.zeros(200)))  # rank mismatch


def test_model_parallel_tensor_layout(layout_map, mesh24):
    mp = ModelParallel(layout_map=layout_map)
    layout = mp.get_tensor_layout("d2/output")
    assert layout.axes == ("data", None)
    assert layout.device_mesh is mesh24
    assert mp.get_tensor_layout("d1/output") is None


def test_model_parallel_data_layout_and_index(layout_map):
    mp = ModelParallel(layout_map=layout_map)
    assert mp.get_data_layout((16, 784)).axes == ("data", None)
    with pytest.raises(ValueError):
        mp.get_data_layout((3, 784))
    # rank r sits at (r // 4, r % 4): the data index is the row
    assert [mp.data_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    mp_model = ModelParallel(layout_map=layout_map, batch_dim_name="model")
    assert [mp_model.data_index(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("shape", [(4, 2), (1, 8), (8, 1)])
def test_changing_mesh_shape_changes_only_the_balance(shape):
    mesh = DeviceMesh(shape, ["data", "model"], devices=EIGHT)
    lm = LayoutMap(mesh)
    lm["d1.weight"] = ("model", None)
    mp = ModelParallel(layout_map=lm)
    assert mp.data_parallel_size == shape[0]
    assert mp.get_variable_layout(("d1.weight", torch.zeros(200, 16))).axes == ("model", None)


def test_top_level_exports():
    assert trainmesh.DataParallel is DataParallel and trainmesh.ModelParallel is ModelParallel
    assert trainmesh.set_distribution is set_distribution and trainmesh.distribution is distribution


# --- set_distribution / distribution / scope ---------------------------------------------------


def test_set_and_clear_distribution():
    assert distribution() is None
    dp = DataParallel(devices=EIGHT[:2])
    set_distribution(dp)
    assert distribution() is dp
    set_distribution(None)
    assert distribution() is None


@pytest.mark.parametrize("value", ["x", 3, object(), DeviceMesh])
def test_set_distribution_rejects_non_distributions(value):
    dp = DataParallel(devices=EIGHT[:2])
    set_distribution(dp)
    with pytest.raises(ValueError):
        set_distribution(value)
    assert distribution() is dp  # unchanged by the rejected call


def test_scope_nests_and_restores(layout_map):
    a = DataParallel(devices=EIGHT[:2])
    b = ModelParallel(layout_map=layout_map)
    base = DataParallel(devices=EIGHT)
    set_distribution(base)
    with a.scope() as got:
        assert got is a and distribution() is a
        with b.scope():
            assert distribution() is b
            with a.scope():
                assert distribution() is a
            assert distribution() is b
        assert distribution() is a
    assert distribution() is base


def test_scope_without_global_distribution_restores_none():
    a = DataParallel(devices=EIGHT[:2])
    with a.scope():
        assert distribution() is a
    assert distribution() is None


def test_scope_restores_on_exception(layout_map):
    a = DataParallel(devices=EIGHT[:2])
    b = ModelParallel(layout_map=layout_map)
    with pytest.raises(RuntimeError, match="boom"):
        with a.scope():
            with b.scope():
                raise RuntimeError("boom")
    assert distribution() is None
    with a.scope():
        with pytest.raises(KeyError):
            with b.scope():
                raise KeyError("x")
        assert distribution() is a
    assert distribution() is None


def test_set_distribution_inside_a_scope_is_undone_on_exit():
    # Keras semantics: scope() is set_distribution(self) ... set_distribution(previous).
    base = DataParallel(devices=EIGHT)
    a = DataParallel(devices=EIGHT[:2])
    c = DataParallel(devices=EIGHT[:4])
    set_distribution(base)
    with a.scope():
        set_distribution(c)
        assert distribution() is c
    assert distribution() is base


def test_scope_is_process_wide():
    # Data-loading and monitoring threads must see the distribution the step runs under.
    a = DataParallel(devices=EIGHT[:2])
    base = DataParallel(devices=EIGHT)
    set_distribution(base)
    seen = []
    with a.scope():
        t = threading.Thread(target=lambda: seen.append(distribution()))
        t.start()
        t.join()
        assert distribution() is a
    assert seen == [a]
    assert distribution() is base


def test_data_parallel_on_a_multi_axis_mesh_warns_and_uses_the_first_axis():
    import trainmesh as tm

    mesh = tm.DeviceMesh((2, 2), ["data", "model"], devices=[f"cpu:{i}" for i in range(4)])
    with pytest.warns(UserWarning, match="first axis 'data' is used as the batch axis"):
        dp = tm.DataParallel(device_mesh=mesh)
    assert dp.batch_dim_name == "data" and dp.data_parallel_size == 2


def test_model_parallel_legacy_device_mesh_keyword_is_deprecated_and_the_layout_maps_mesh_wins():
    import trainmesh as tm

    mesh = tm.DeviceMesh((2, 2), ["data", "model"], devices=[f"cpu:{i}" for i in range(4)])
    other = tm.DeviceMesh((4, 1), ["data", "model"], devices=[f"cpu:{i}" for i in range(4)])
    layout_map = tm.LayoutMap(mesh)
    with pytest.warns(DeprecationWarning, match="device_mesh"):
        mp = tm.ModelParallel(device_mesh=other, layout_map=layout_map, batch_dim_name="data")
    assert mp.device_mesh is mesh
