"""Reading safetensors by byte range, checking files against a model, and initialising a meta model
in one process (the multiprocess side is tests/multiprocess/test_meta_build.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from trainmesh._torch.materialize import materialize, prepare
from trainmesh.checkpoint import safetensors_reader
from trainmesh.checkpoint.safetensors_reader import WeightFileError, WeightFiles

pytestmark = pytest.mark.timeout(120)
st = pytest.importorskip("safetensors.torch")


@pytest.fixture()
def tensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    values = {
        "cube": torch.randn(7, 5, 3, generator=g),
        "matrix": torch.randn(9, 11, generator=g),
        "half": torch.randn(6, generator=g).bfloat16(),
        "scalar": torch.tensor(2.5),
    }
    st.save_file(values, str(tmp_path / "model.safetensors"))
    return values


@pytest.mark.parametrize("block_bytes", [16 << 20, 40])  # one block, and many blocks of one row or less
def test_regions_equal_slices_of_the_tensor(tmp_path, tensors, monkeypatch, block_bytes):
    monkeypatch.setattr(safetensors_reader, "BLOCK_BYTES", block_bytes)
    files = WeightFiles.open(tmp_path)
    assert torch.equal(files.read_region("cube", (2, 0, 0), (3, 5, 3)), tensors["cube"][2:5])  # rows
    assert torch.equal(files.read_region("cube", (1, 1, 1), (6, 3, 2)), tensors["cube"][1:7, 1:4, 1:3])
    assert torch.equal(files.read_region("matrix", (2, 3), (5, 4)), tensors["matrix"][2:7, 3:7])  # columns
    out = torch.empty(5, 4, dtype=torch.float64)  # another dtype: converted on the way
    files.read_region("matrix", (2, 3), (5, 4), out=out)
    assert torch.equal(out, tensors["matrix"][2:7, 3:7].double())
    widened = files.read_region("half", (1,), (4,), out=torch.empty(4))
    assert torch.equal(widened, tensors["half"][1:5].float())
    assert files.read_region("scalar", (), ()).item() == 2.5


def test_fill_reads_each_file_once_in_file_order_bit_identical(tmp_path, monkeypatch):
    """fill: two files of a sharded directory, pieces given out of order: uneven row shards that
    cover a tensor (the last one short, as FSDP2's last rank holds), a column slice, a piece into a
    non-contiguous destination, a bf16 tensor into fp32; one open and one fadvise pass per file."""
    g = torch.Generator().manual_seed(1)
    first = {"a": torch.randn(10, 6, generator=g), "b": torch.randn(4, 8, generator=g)}
    second = {"c": torch.randn(7, 3, generator=g).bfloat16(), "d": torch.randn(5, 5, generator=g)}
    st.save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    st.save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    names = {
        **{k: "model-00001-of-00002.safetensors" for k in first},
        **{k: "model-00002-of-00002.safetensors" for k in second},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    opened, advised = [], []
    real_open = open
    monkeypatch.setattr(
        safetensors_reader, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k), raising=False
    )
    monkeypatch.setattr(safetensors_reader, "_advise", lambda fd, spans: advised.append(spans))
    files = WeightFiles.open(tmp_path)
    opened.clear()
    rows = [torch.empty(3, 6) for _ in range(3)] + [torch.empty(1, 6)]  # 10 rows over 4: 3, 3, 3, 1
    transposed = torch.empty(5, 5).t()  # a non-contiguous destination
    columns, widened = torch.empty(4, 3), torch.empty(7, 3)
    items = [("d", None, transposed, (0, 0), (5, 5)), ("b", None, columns, (0, 5), (4, 3))]
    items += [("a", None, out, (3 * i, 0), tuple(out.shape)) for i, out in reversed(list(enumerate(rows)))]
    items.append(("c", None, widened, (0, 0), (7, 3)))
    files.fill(items)
    assert torch.equal(torch.cat(rows), first["a"])
    assert torch.equal(columns, first["b"][:, 5:])
    assert torch.equal(transposed, second["d"])
    assert torch.equal(widened, second["c"].float())
    assert sorted(os.path.basename(p) for p in opened) == sorted(set(names.values()))
    assert sorted(len(spans) for spans in advised) == [2, 5]  # every piece announced, per file
    assert all(spans == sorted(spans) for spans in advised)  # in file order


def test_a_truncated_file_is_named(tmp_path, tensors):
    path = tmp_path / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)
    with pytest.raises(WeightFileError, match=r"model\.safetensors: truncated file: tensor"):
        WeightFiles.open(tmp_path)


def test_an_index_naming_an_absent_file_is_named(tmp_path, tensors):
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    weight_map = {"cube": "model-00001-of-00002.safetensors", "matrix": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightFileError, match=r"names 1 file\(s\) that are not in .*model-00002-of-00002"):
        WeightFiles.open(tmp_path)


def test_not_a_safetensors_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(WeightFileError, match="truncated or not a safetensors file"):
        WeightFiles.open(tmp_path)
    with pytest.raises(WeightFileError, match="neither"):
        WeightFiles.open(tmp_path / "nothing-here")


class Net(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, 3)


def _save(model: nn.Module, path) -> None:
    st.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def test_files_that_do_not_fit_the_model_are_refused_naming_the_key(tmp_path):
    _save(Net(width=5), tmp_path / "wider.safetensors")
    with pytest.raises(WeightFileError, match=r"key 'blocks.0.weight' has shape \[5, 5\].*the model's is \[4, 4\]"):
        prepare(Net(), tmp_path / "wider.safetensors")
    state = Net().state_dict()
    del state["head.bias"]
    state["extra"] = torch.zeros(1)
    st.save_file(state, str(tmp_path / "odd.safetensors"))
    with pytest.raises(WeightFileError, match=r"missing key 'head.bias'.*unexpected key 'extra'"):
        prepare(Net(), tmp_path / "odd.safetensors")


def test_a_meta_model_is_filled_from_a_file_or_by_its_initialisers(tmp_path):
    torch.manual_seed(0)
    source = Net()
    _save(source, tmp_path / "net.safetensors")
    with torch.device("meta"):
        model = Net()
    materialize(model, prepare(model, tmp_path / "net.safetensors"), "cpu")
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    with torch.device("meta"):
        first, second, other = Net(), Net(), Net()
    for net, seed in ((first, 1), (second, 1), (other, 2)):
        materialize(net, prepare(net, None, seed), "cpu")
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    assert not torch.equal(first.head.weight, other.head.weight)
    bound = 1 / 2  # nn.Linear's reset_parameters: uniform within 1/sqrt(fan_in)
    assert 0 < float(first.blocks[0].weight.detach().abs().max()) <= bound


def test_the_plan_keeps_no_cpu_copy_of_what_it_initialised():
    """Each unit is built whole on the CPU to run its initialisers; that copy must go when the unit's
    values are copied out (the plan outlives the load: it held a whole model's worth of blocks)."""
    with torch.device("meta"):
        model = Net()
    plan = prepare(model, None, 0)
    materialize(model, plan, "cpu")
    assert plan.units
    for unit in plan.units:
        assert all(t.is_meta for t in [*unit.shadow.parameters(), *unit.shadow.buffers()]), unit.path


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))  # no reset_parameters sets it


def test_a_tensor_no_initialiser_sets_is_refused_by_name():
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ValueError, match="No initialiser sets 'scale'"):
        materialize(model, prepare(model, None, 0), "cpu")


def test_a_model_partly_on_meta_is_refused():
    model = Net()
    model.head.to_empty(device="meta")
    with pytest.raises(ValueError, match="partly on the meta device"):
        prepare(model, None)
