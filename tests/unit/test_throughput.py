"""Throughput and MFU: FLOPs per sample from FlopCounterMode on a meta copy, the peak probe and its
cache, and the Trainer's records (JSONL) and progress bar carrying tokens/s and MFU."""

from __future__ import annotations

import json

import pytest
import torch

from trainmesh.trainer.throughput import (
    ThroughputMeter,
    cached_peak_flops,
    count_flops_per_sample,
    measure_peak_flops,
    meta_copy,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("serial")]


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_flops_per_sample_match_the_matmul_count_and_leave_the_model_alone():
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    meta = meta_copy(model)
    assert all(p.device.type == "meta" for p in meta.parameters())
    flops = count_flops_per_sample(meta, torch.randn(5, 8), torch.randn(5, 4), torch.nn.MSELoss(), rows=5)
    # layer 1: forward + weight gradient (its input needs no gradient): 2 x 2*8*16; layer 2: 3 x 2*16*4
    assert flops == 2 * 2 * 8 * 16 + 3 * 2 * 16 * 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_model_that_cannot_run_on_meta_gives_no_count():
    class ItemInForward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * float(x.sum().item())

    meta = meta_copy(ItemInForward())
    assert count_flops_per_sample(meta, torch.randn(2, 4), torch.randn(2, 4), torch.nn.MSELoss(), rows=2) is None


def test_peak_probe_is_cached_per_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINMESH_CACHE_DIR", str(tmp_path))
    assert cached_peak_flops(torch.float32) is None
    peak = measure_peak_flops(torch.float32, seconds=0.2, sizes=(128,))
    assert peak > 1e6  # any CPU does more than a megaflop per second
    assert cached_peak_flops(torch.float32) == peak
    assert cached_peak_flops(torch.bfloat16) is None
    with pytest.raises(ValueError, match="int8"):
        measure_peak_flops(torch.int8)


def test_peak_probe_keeps_to_its_time_on_any_dtype():
    """bf16 on a CPU without a native bf16 matmul runs ~45x slower than fp32: a probe that always
    reached 2048-wide matmuls took minutes there. The sizes it tries must stop at the budget."""
    import time

    for dtype in (torch.float32, torch.bfloat16):
        started = time.perf_counter()
        peak = measure_peak_flops(dtype, seconds=1.0, save=False)
        elapsed = time.perf_counter() - started
        assert peak > 1e6
        assert elapsed < 6.0, (dtype, elapsed)  # 1 s asked; wall time on a busy machine adds slack, not minutes


def test_fastest_precision_follows_the_measured_bf16_speedup(monkeypatch):
    from trainmesh.runtime import cpu
    from trainmesh.trainer import precision

    speedup = precision.bf16_matmul_speedup("cpu")
    assert speedup > 0
    # The speed-up decides where the CPU kind does not (AVX512-BF16 here; AMX and AVX2-only CPUs are
    # decided by their kind: tests/unit/test_cpu_kinds.py), whatever CPU runs this test.
    monkeypatch.setattr(cpu, "cpu_features", lambda: frozenset({"avx2", "avx512", "avx512_bf16"}))
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda device_type="cpu": 3.0)
    assert precision.fastest_precision("cpu")[0] == "bf16-mixed"
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda device_type="cpu": 0.03)
    name, why = precision.fastest_precision("cpu")
    assert name == "fp32" and "0.03x" in why


def test_meter_mfu_is_achieved_over_peak():
    meter = ThroughputMeter(peak_flops=1e9, peak_units=2)
    meter.flops_per_sample, meter.tokens_per_sample = 1e6, 10
    rates = meter.report(samples=100)
    assert rates["tokens_per_s"] == pytest.approx(10 * rates["samples_per_s"])
    assert rates["mfu"] == pytest.approx(rates["samples_per_s"] * 1e6 / 2e9)
    assert set(meter.progress_values(rates)) == {"tok/s", "mfu"}


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=11, dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_trainer_logs_tokens_per_s_and_mfu(tmp_path, capsys):
    import trainmesh as tm

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (32, 6), generator=g)
    model = TinyLM()
    trainer = tm.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss, peak_flops=1e9, log_dir=tmp_path, progress=True
    )
    history = trainer.fit((tokens, tokens.roll(1, dims=1)), epochs=1, batch_size=8)
    # forward + backward of the head (3 x 2*16*11 per token); the embedding is a lookup, 0 FLOPs
    assert trainer._meter.flops_per_sample == 6 * 3 * 2 * 16 * 11
    assert trainer._meter.tokens_per_sample == 6
    for step in history.steps:
        assert step["tokens_per_s"] == pytest.approx(6 * step["samples_per_s"])
        assert step["mfu"] == pytest.approx(step["samples_per_s"] * 6 * 3 * 2 * 16 * 11 / 1e9)
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert any("mfu" in line and "tokens_per_s" in line for line in lines)
    out = capsys.readouterr().out
    assert "tok/s" in out and "mfu" in out


def test_optimizer_implementation_switches_kernels_and_keeps_the_result():
    import trainmesh as tm
    from trainmesh.trainer.step import set_optimizer_implementation

    x, y = torch.randn(32, 8), torch.randn(32, 4)
    params = {}
    for impl in (None, "fused", "foreach", "for-loop"):
        model = mlp()
        trainer = tm.Trainer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            torch.nn.MSELoss(),
            optimizer_implementation=impl,
            max_grad_norm=0.5,
            progress=False,
        )
        group = trainer.optimizer.param_groups[0]
        if impl is not None:
            assert (group["fused"], group["foreach"]) == {
                "fused": (True, False),
                "foreach": (False, True),
                "for-loop": (False, False),
            }[impl]
        trainer.fit((x, y), epochs=2, batch_size=8)
        params[impl] = torch.cat([p.detach().flatten() for p in trainer.unwrapped_model.parameters()])
    for impl in ("fused", "foreach", "for-loop"):
        assert (params[impl] - params[None]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="'fast'"):
        set_optimizer_implementation(torch.optim.SGD(mlp().parameters(), lr=0.1), "fast")
    with pytest.warns(RuntimeWarning, match="LBFGS has no 'fused'"):
        set_optimizer_implementation(torch.optim.LBFGS(mlp().parameters()), "fused")


@pytest.mark.usefixtures("no_process_group_left_behind")
@pytest.mark.parametrize("implementation", [None, "foreach"])
def test_a_tensor_layout_trains_with_a_foreach_optimizer(implementation):
    """A layout shards some parameters (DTensors) and leaves the rest plain; torch's foreach kernels,
    its default on CUDA, refuse such a mix in one call. The Trainer gives that group the for-loop
    kernels and the result equals a for-loop optimizer's."""
    import trainmesh as tm

    x, y = torch.randn(32, 8), torch.randn(32, 4)
    params = {}
    for foreach in (False, True):
        model = mlp()
        mesh = tm.DeviceMesh((1, 1), ["data", "model"], devices=tm.list_devices())
        layout_map = tm.LayoutMap(mesh)
        layout_map[r"0\.weight"] = ("model", None)  # the first layer sharded; the rest plain
        trainer = tm.Trainer(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2, foreach=foreach),
            torch.nn.MSELoss(),
            distribution=tm.ModelParallel(layout_map=layout_map, batch_dim_name="data"),
            optimizer_implementation=implementation if foreach else None,
            progress=False,
        )
        assert {hasattr(p, "placements") for p in trainer.optimizer.param_groups[0]["params"]} == {True, False}
        trainer.fit((x, y), epochs=2, batch_size=8)
        params[foreach] = torch.cat(
            [
                p.detach().full_tensor().flatten() if hasattr(p, "full_tensor") else p.detach().flatten()
                for p in trainer.unwrapped_model.parameters()
            ]
        )
    assert (params[True] - params[False]).abs().max() <= 1e-6


def test_env_peak_measures_caches_and_prints(tmp_path, monkeypatch, capsys):
    from trainmesh.launcher.cli import main

    monkeypatch.setenv("TRAINMESH_CACHE_DIR", str(tmp_path))
    assert main(["env", "--peak", "fp32", "--peak-seconds", "0.2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["peak_dtype"] == "fp32" and report["peak_flops"] > 1e6
    device_type = "cuda" if torch.cuda.is_available() else "cpu"  # env --peak probes the job's device
    assert cached_peak_flops(torch.float32, device_type) == report["peak_flops"]  # what the Trainer's MFU will use
    assert main(["env", "--peak", "fp32", "--peak-seconds", "0"]) == 1
    assert "--peak-seconds must be > 0" in capsys.readouterr().err
