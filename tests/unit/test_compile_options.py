"""compile= validation, and the eager fallback with a warning naming why compilation is impossible."""

from __future__ import annotations

import pytest
import torch

from trainmesh._torch import compile as tm_compile
from trainmesh.trainer.config import TrainerConfig

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("bad", ["yes", 1, "whole", None])
def test_bad_compile_values_raise_naming_them(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
        TrainerConfig(compile=bad)


def test_bad_backend_and_peak_raise():
    with pytest.raises(ValueError, match="compile_backend"):
        TrainerConfig(compile=True, compile_backend="")
    with pytest.raises(ValueError, match="peak_flops=-1"):
        TrainerConfig(peak_flops=-1)


def test_without_a_cxx_compiler_inductor_warns_and_runs_eager(monkeypatch, tmp_path):
    from torch._inductor import config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "no-such-compiler"))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no g++, c++ or clang++
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.warns(RuntimeWarning, match=r"compile='regional' is not possible here: .*C\+\+ compiler"):
        out = tm_compile.apply_compile(model, "regional")
    assert out is model and tm_compile.compiled_mode(model) is False
    assert not any(tm_compile.is_compiled_in_place(m) for m in model.modules())


def test_regional_compiles_each_repeated_block_in_place():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 8)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    model = Net()
    names = [n for n, _ in model.named_parameters()]
    tm_compile.apply_compile(model, "regional", backend="eager")
    assert [tm_compile.is_compiled_in_place(b) for b in model.blocks] == [True] * 3
    assert not tm_compile.is_compiled_in_place(model.inp)
    assert [n for n, _ in model.named_parameters()] == names  # no _orig_mod in any name
    assert tm_compile.compiled_mode(model) == "regional"
    # and dynamo really traces them: nn.Module.compile() on torch 2.11 traced nothing, silently
    from torch._dynamo import reset as reset_dynamo
    from torch._dynamo.utils import counters

    reset_dynamo()
    counters.clear()
    x = model.inp(torch.randn(2, 4))
    for block in model.blocks:
        x = block(x)
    assert counters["frames"]["ok"] >= 1 and counters["stats"]["unique_graphs"] == 1  # one graph, reused
    flat = torch.nn.Linear(2, 2)  # no repeated blocks: compiled whole
    tm_compile.apply_compile(flat, "regional", backend="eager")
    assert tm_compile.is_compiled_in_place(flat) and tm_compile.compiled_mode(flat) is True


def test_bad_compile_mode_raises_naming_it():
    with pytest.raises(ValueError, match="Received: compile_mode='fastest'"):
        TrainerConfig(compile="regional", compile_mode="fastest")
    with pytest.raises(ValueError, match="inductor backend only.*compile_backend='aot_eager'"):
        TrainerConfig(compile="regional", compile_backend="aot_eager", compile_mode="max-autotune")
    assert TrainerConfig(compile="regional", compile_mode="reduce-overhead").compile_mode == "reduce-overhead"


@pytest.mark.usefixtures("no_process_group_left_behind")  # the Trainer starts a one-process group
def test_compile_mode_reaches_torch_compile(monkeypatch):
    import trainmesh as tm

    seen = []
    real_compile = torch.compile

    def recording_compile(fn, **kwargs):  # what the Trainer asked for, then a cheap real compile
        seen.append(kwargs)
        return real_compile(fn, backend="eager")

    monkeypatch.setattr(torch, "compile", recording_compile)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    trainer = tm.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.MSELoss(),
        compile="regional",
        compile_mode="max-autotune-no-cudagraphs",
        progress=False,
    )
    assert seen and all(kw["mode"] == "max-autotune-no-cudagraphs" and kw["backend"] == "inductor" for kw in seen)
    assert len(seen) == 2  # one per block: regional
    trainer.fit((torch.randn(8, 4), torch.randn(8, 4)), epochs=1, batch_size=4)
    model = torch.nn.Linear(4, 4)
    seen.clear()
    tm.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(), compile=True, progress=False)
    assert [kw["mode"] for kw in seen] == [None]  # unset: torch's default
