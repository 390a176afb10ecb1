"""DeviceMesh, TensorLayout and LayoutMap: pure metadata, 8 logical devices in one process."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from trainmesh.distribution import DeviceMesh, LayoutMap, TensorLayout
from trainmesh.runtime import process_group

pytestmark = pytest.mark.timeout(60)

EIGHT = [f"cpu:{i}" for i in range(8)]


@pytest.fixture
def single_process(monkeypatch):
    """One uninitialized CPU process, whatever the surrounding environment says."""
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TF_CONFIG") or name.startswith(
            ("TRAINMESH_", "SLURM_")
        ):
            monkeypatch.delenv(name)
    monkeypatch.setattr(process_group, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def mesh24():
    return DeviceMesh((2, 4), ["data", "model"], devices=EIGHT)


# --- DeviceMesh ------------------------------------------------------------------------------


def test_mesh_of_eight_logical_devices(mesh24):
    assert mesh24.shape == (2, 4)
    assert mesh24.axis_names == ["data", "model"]
    assert isinstance(mesh24.devices, np.ndarray)
    assert mesh24.devices.shape == (2, 4)
    assert mesh24.devices.tolist() == [EIGHT[:4], EIGHT[4:]]
    assert mesh24.size == 8
    assert mesh24.axis_size("data") == 2 and mesh24.axis_size("model") == 4
    assert mesh24.axis_index("model") == 1


def test_coordinate_of(mesh24):
    assert mesh24.coordinate_of(0) == (0, 0)
    assert mesh24.coordinate_of(5) == (1, 1)
    assert mesh24.coordinate_of(7) == (1, 3)
    assert mesh24.coordinate_of(8) is None
    assert mesh24.ranks().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_coordinate_follows_device_order():
    mesh = DeviceMesh((2, 2), ["a", "b"], devices=["cpu:3", "cpu:2", "cpu:1", "cpu:0"])
    assert mesh.coordinate_of(3) == (0, 0)
    assert mesh.coordinate_of(0) == (1, 1)


def test_devices_may_be_given_as_an_array():
    mesh = DeviceMesh((4, 2), ["x", "y"], devices=np.array(EIGHT).reshape(2, 4))
    assert mesh.devices.shape == (4, 2)
    assert mesh.devices.ravel().tolist() == EIGHT


def test_axis_size_unknown_axis(mesh24):
    with pytest.raises(ValueError, match="batch"):
        mesh24.axis_size("batch")


def test_mesh_equality_and_hash():
    a = DeviceMesh((2, 4), ["data", "model"], devices=EIGHT)
    b = DeviceMesh([2, 4], ("data", "model"), devices=list(EIGHT))
    assert a == b and hash(a) == hash(b)
    assert a != DeviceMesh((4, 2), ["data", "model"], devices=EIGHT)
    assert a != DeviceMesh((2, 4), ["batch", "model"], devices=EIGHT)
    assert a != DeviceMesh((2, 4), ["data", "model"], devices=EIGHT[::-1])


@pytest.mark.parametrize(
    "shape,axis_names,devices,match",
    [
        ((), ["a"], EIGHT[:1], "[Ss]hape"),
        ([], ["a"], EIGHT[:1], "[Ss]hape"),
        ((8,), [], EIGHT, "[Aa]xis names"),
        ((2, 4), ["a"], EIGHT, "length"),
        ((8,), ["a", "b"], EIGHT, "length"),
        ((2, 2), ["a", "b"], EIGHT, "mismatch"),
        ((4, 4), ["a", "b"], EIGHT, "mismatch"),
        ((2, 4), ["a", "a"], EIGHT, "unique"),
        ((2,), ["a"], ["cpu:0", "cpu:0"], "once"),
        ((0, 8), ["a", "b"], EIGHT, "at least one"),
        ((2,), ["a"], ["cpu0", "cpu:1"], "device name"),
        ((2,), ["a"], ["cpu:x", "cpu:1"], "device name"),
        ((2,), ["a"], ["cpu:", "cpu:1"], "device name"),
        ((2,), ["a"], ["", "cpu:1"], "device name"),
    ],
    ids=[
        "empty-shape",
        "empty-shape-list",
        "empty-axes",
        "fewer-names",
        "more-names",
        "too-few-dims",
        "too-many-dims",
        "duplicate-axis",
        "duplicate-device",
        "zero-axis",
        "no-colon",
        "non-int-index",
        "no-index",
        "empty-name",
    ],
)
def test_mesh_value_errors(shape, axis_names, devices, match):
    with pytest.raises(ValueError, match=match):
        DeviceMesh(shape, axis_names, devices=devices)


def test_axis_names_as_a_string_is_rejected():
    with pytest.raises(TypeError):
        DeviceMesh((2,), "ab", devices=EIGHT[:2])


@pytest.mark.parametrize("bad", ["cpu:-1", "cpu:0:1"])
def test_mesh_rejects_negative_or_multi_colon_device_names(bad):
    with pytest.raises(ValueError, match="device"):
        DeviceMesh((2,), ["a"], devices=[bad, "cpu:5"])


def test_mesh_rejects_two_names_for_the_same_rank():
    with pytest.raises(ValueError):
        DeviceMesh((2,), ["a"], devices=["cpu:0", "gpu:0"])


def test_default_devices_single_process(single_process):
    mesh = DeviceMesh((1,), ["batch"])
    assert mesh.devices.tolist() == ["cpu:0"]
    with pytest.raises(ValueError, match="mismatch"):
        DeviceMesh((2,), ["batch"])


def test_default_devices_follow_the_detected_job(single_process, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    mesh = DeviceMesh((2, 2), ["data", "model"])
    assert mesh.devices.tolist() == [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]]


# --- TensorLayout ----------------------------------------------------------------------------


def test_layout_axes_and_mesh(mesh24):
    layout = TensorLayout(["model", None])
    assert layout.axes == ("model", None)
    assert layout.device_mesh is None
    layout.device_mesh = mesh24
    assert layout.device_mesh is mesh24
    assert TensorLayout(("data", None, "model"), mesh24).device_mesh is mesh24


def test_layout_axis_not_in_mesh_in_constructor(mesh24):
    with pytest.raises(ValueError, match="batch"):
        TensorLayout(("batch", None), mesh24)


def test_layout_axis_not_in_mesh_when_mesh_set_later(mesh24):
    layout = TensorLayout(("batch", None))
    with pytest.raises(ValueError, match="batch"):
        layout.device_mesh = mesh24
    assert layout.device_mesh is None  # a rejected mesh is not kept


def test_layout_cannot_switch_mesh(mesh24):
    layout = TensorLayout(("model", None), mesh24)
    other = DeviceMesh((4, 2), ["data", "model"], devices=EIGHT)
    with pytest.raises(ValueError, match="override"):
        layout.device_mesh = other
    assert layout.device_mesh is mesh24
    # an equal mesh is not a change
    layout.device_mesh = DeviceMesh((2, 4), ["data", "model"], devices=EIGHT)
    assert layout.device_mesh == mesh24


def test_layout_rejects_string_and_non_string_axes():
    with pytest.raises(TypeError):
        TensorLayout("model")
    with pytest.raises(TypeError):
        TensorLayout((0, None))


def test_layout_one_mesh_axis_shards_one_dim():
    with pytest.raises(ValueError):
        TensorLayout(("model", "model"))


def test_validate_for_shape(mesh24):
    layout = TensorLayout(("model", None), mesh24)
    layout.validate_for_shape((8, 3), "d1.weight")  # 8 % 4 == 0, dim 1 replicated
    layout.validate_for_shape(torch.Size([4, 5]), "d1.weight")
    with pytest.raises(ValueError, match=r"d1\.weight"):
        layout.validate_for_shape((6, 3), "d1.weight")  # 6 % 4 != 0
    with pytest.raises(ValueError, match=r"enc\.proj\.weight"):
        layout.validate_for_shape((8,), "enc.proj.weight")  # rank mismatch
    with pytest.raises(ValueError, match=r"enc\.proj\.weight"):
        layout.validate_for_shape((8, 3, 1), "enc.proj.weight")


def test_validate_for_shape_without_mesh_checks_rank_only():
    layout = TensorLayout(("model", None))
    layout.validate_for_shape((7, 3), "w")
    with pytest.raises(ValueError, match="w"):
        layout.validate_for_shape((7,), "w")


def test_layout_equality(mesh24):
    assert TensorLayout(("model", None), mesh24) == TensorLayout(["model", None], mesh24)
    assert TensorLayout(("model", None), mesh24) != TensorLayout(("model", None))
    assert TensorLayout(("model", None), mesh24) != TensorLayout((None, "model"), mesh24)


# --- LayoutMap -------------------------------------------------------------------------------


def test_exact_key_wins_over_regexes(mesh24):
    lm = LayoutMap(mesh24)
    lm["d1.*"] = (None, "model")
    lm["d1.weight"] = ("model", None)
    lm[".*weight"] = ("data", None)
    assert lm["d1.weight"].axes == ("model", None)


def test_keys_are_full_match_regexes(mesh24):
    lm = LayoutMap(mesh24)
    lm["d1"] = ("model", None)
    assert lm["d1.weight"] is None  # no partial (re.search) match
    assert lm["d1"].axes == ("model", None)
    lm["enc\\.layers\\.\\d+\\.weight"] = (None, "model")
    assert lm["enc.layers.12.weight"].axes == (None, "model")
    assert lm["enc.layers.12.weight.extra"] is None
    assert lm["xenc.layers.1.weight"] is None


def test_prefix_regex_matches(mesh24):
    lm = LayoutMap(mesh24)
    lm["d1.*"] = ("model", None)
    assert lm["d1.weight"].axes == ("model", None)
    assert lm["d1.bias"].axes == ("model", None)
    assert lm["d2.weight"] is None


def test_two_regex_matches_raise_naming_path_and_keys(mesh24):
    lm = LayoutMap(mesh24)
    lm["d1.*"] = ("model", None)
    lm[".*weight"] = (None, "model")
    with pytest.raises(ValueError) as info:
        lm["d1.weight"]
    message = str(info.value)
    assert "d1.weight" in message and "d1.*" in message and ".*weight" in message
    # still fine for paths only one key matches
    assert lm["d2.weight"].axes == (None, "model")
    assert lm["d1.bias"].axes == ("model", None)


def test_no_match_is_none(mesh24):
    lm = LayoutMap(mesh24)
    assert lm["anything"] is None
    lm["a"] = (None,)
    assert lm["b"] is None


@pytest.mark.parametrize("value", [("model", None), ["model", None]])
def test_sequence_value_becomes_layout_on_the_map_mesh(mesh24, value):
    lm = LayoutMap(mesh24)
    lm["d1.weight"] = value
    layout = lm["d1.weight"]
    assert isinstance(layout, TensorLayout)
    assert layout.axes == ("model", None)
    assert layout.device_mesh is mesh24


def test_layout_without_mesh_gets_the_map_mesh(mesh24):
    lm = LayoutMap(mesh24)
    layout = TensorLayout((None, "data"))
    lm["w"] = layout
    assert lm["w"] is layout and layout.device_mesh is mesh24


def test_bad_axis_rejected_when_set(mesh24):
    lm = LayoutMap(mesh24)
    with pytest.raises(ValueError, match="batch"):
        lm["d1.weight"] = ("batch", None)
    assert "d1.weight" not in lm and len(lm) == 0
    with pytest.raises(ValueError, match="batch"):
        lm["d2.weight"] = TensorLayout(("batch", None))
    assert len(lm) == 0


def test_bad_values_and_keys(mesh24):
    lm = LayoutMap(mesh24)
    with pytest.raises(ValueError):
        lm["w"] = "model"
    with pytest.raises(ValueError):
        lm["w"] = None
    with pytest.raises(ValueError):
        lm["w["] = ("model",)  # not a regex
    with pytest.raises(TypeError):
        lm[3] = ("model",)
    assert len(lm) == 0


def test_setting_an_existing_key_raises(mesh24):
    lm = LayoutMap(mesh24)
    lm["d1.weight"] = ("model", None)
    with pytest.raises(ValueError, match=r"d1\.weight"):
        lm["d1.weight"] = (None, "model")
    assert lm["d1.weight"].axes == ("model", None)
    # a key that merely matches as a regex is a new key
    lm["d1.*"] = (None, None)
    assert len(lm) == 2


def test_del_is_exact_key_only(mesh24):
    lm = LayoutMap(mesh24)
    lm["d1.*"] = ("model", None)
    with pytest.raises(KeyError):
        del lm["d1.weight"]
    assert "d1.*" in lm
    del lm["d1.*"]
    assert "d1.*" not in lm and len(lm) == 0
    with pytest.raises(KeyError):
        del lm["d1.*"]
    lm["d1.*"] = (None, "model")  # can be set again after deletion
    assert lm["d1.x"].axes == (None, "model")


def test_iteration_order_contains_len(mesh24):
    lm = LayoutMap(mesh24)
    keys = ["z.weight", "a.*", "m/output", "b.bias"]
    for k in keys:
        lm[k] = (None,)
    assert list(lm) == keys
    assert list(lm.keys()) == keys
    assert len(lm) == 4
    assert "a.*" in lm
    assert "a.weight" not in lm  # membership is exact, even though lm["a.weight"] matches
    assert lm["a.weight"] is not None
    del lm["a.*"]
    assert list(lm) == ["z.weight", "m/output", "b.bias"] and len(lm) == 3


def test_output_paths(mesh24):
    lm = LayoutMap(mesh24)
    lm["d2/output"] = ("data", None)
    lm["enc.*/output"] = ("data", "model")
    assert lm["d2/output"].axes == ("data", None)
    assert lm["enc.block1/output"].axes == ("data", "model")
    assert lm["d2.weight"] is None


def test_layout_map_device_mesh(mesh24):
    assert LayoutMap(mesh24).device_mesh is mesh24
    lm = LayoutMap()
    lm["w"] = ("anything", None)  # without a mesh nothing can be validated yet
    assert lm["w"].device_mesh is None
