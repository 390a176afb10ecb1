"""The paths that depend on the kind of CPU (AVX2 only, AVX512-BF16, AMX), each taken on any CPU:
torch's feature detection (``torch.cpu``'s detectors, which ``trainmesh.runtime.cpu`` reads) is
simulated, so a machine of one kind tests the other kinds' paths too.

What the CPU changes: ``fastest_precision`` (bf16-mixed on AMX without timing, fp32 on AVX2 only
without timing, measured on AVX512), and the matmul peak the MFU divides by (cached per CPU kind,
so an AMX machine's MFU is against an AMX peak, never one probed on another kind of CPU).
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from trainmesh.launcher import demo as demo_cmd
from trainmesh.runtime import cpu
from trainmesh.trainer import precision, throughput

pytestmark = pytest.mark.timeout(60)

# What torch's detectors answer on each kind of CPU these machines have had (an AMX CPU also has
# AVX512-BF16, as Sapphire Rapids does; an AVX512-BF16 one is, for example, AMD EPYC Zen 4).
SIMULATED = {
    "avx2": {"avx2"},
    "avx512_bf16": {"avx2", "avx512", "avx512_bf16"},
    "amx": {"avx2", "avx512", "avx512_bf16", "amx"},
}
_DETECTORS = {
    "amx": "_is_amx_tile_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "avx512": "_is_avx512_supported",
    "avx2": "_is_avx2_supported",
}


@pytest.fixture
def simulate(monkeypatch):
    """``simulate("amx")``: torch.cpu's feature detectors answer as on that kind of CPU."""

    def as_on(kind: str) -> None:
        for feature, name in _DETECTORS.items():
            monkeypatch.setattr(torch.cpu, name, lambda present=feature in SIMULATED[kind]: present)

    return as_on


def _untimed(device_type: str = "cpu") -> float:
    raise AssertionError("bf16_matmul_speedup ran where the CPU kind decides")


@pytest.mark.parametrize("kind", sorted(SIMULATED))
def test_cpu_kind_reads_torchs_feature_detection(simulate, kind):
    simulate(kind)
    assert cpu.cpu_features() == frozenset(SIMULATED[kind])
    assert cpu.cpu_kind() == kind


def test_an_unknown_cpu_is_other(monkeypatch):
    for name in _DETECTORS.values():  # an older torch, or a detector that cannot tell
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert cpu.cpu_features() == frozenset() and cpu.cpu_kind() == "other"

    def cannot_tell() -> bool:
        raise RuntimeError("cpuinfo failed to initialize")

    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", cannot_tell, raising=False)
    assert cpu.cpu_kind() == "other"
    with pytest.raises(ValueError, match="Received: kind='sse'"):
        cpu.describe_cpu_kind("sse")


def test_the_real_cpu_is_one_of_the_kinds():
    assert cpu.cpu_kind() in cpu.CPU_KINDS


def test_amx_chooses_bf16_without_timing(simulate, monkeypatch):
    simulate("amx")
    monkeypatch.setattr(precision, "bf16_matmul_speedup", _untimed)
    name, why = precision.fastest_precision("cpu")
    assert name == "bf16-mixed" and "AMX" in why


def test_avx2_only_chooses_fp32_without_timing(simulate, monkeypatch):
    simulate("avx2")
    monkeypatch.setattr(precision, "bf16_matmul_speedup", _untimed)
    name, why = precision.fastest_precision("cpu")
    assert name == "fp32" and "AVX2 only" in why


@pytest.mark.parametrize("speedup, chosen", [(2.3, "bf16-mixed"), (1.2, "fp32")])
def test_avx512_bf16_follows_the_measured_speedup(simulate, monkeypatch, speedup, chosen):
    simulate("avx512_bf16")
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda device_type="cpu": speedup)
    name, why = precision.fastest_precision("cpu")
    assert name == chosen and f"{speedup}x" in why and "AVX512-BF16" in why


def test_each_cpu_kind_keeps_its_own_peak(simulate, tmp_path, monkeypatch):
    """One cache directory on CPUs that share a model name and torch's "AVX512" capability: the
    peak probed on an AVX512-BF16 CPU is not an AMX CPU's, whose bf16 rate is several times it."""
    monkeypatch.setenv("TRAINMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(throughput, "_device_name", lambda device_type: "Intel Xeon Processor")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    simulate("avx512_bf16")
    peak = throughput.measure_peak_flops(torch.bfloat16, seconds=0.2, sizes=(128,))
    assert throughput.cached_peak_flops(torch.bfloat16) == peak
    simulate("amx")
    assert throughput.cached_peak_flops(torch.bfloat16) is None  # so the demo probes this CPU
    keys = json.loads((tmp_path / "peak_flops.json").read_text())
    assert [k for k in keys if "|avx512_bf16|" in k] == list(keys)


def _auto_demo_args() -> argparse.Namespace:
    return argparse.Namespace(precision="auto", nproc_per_node=None, out="out", epochs=None, quick=True)


@pytest.mark.parametrize(
    "kind, chosen, dtype", [("amx", "bf16-mixed", torch.bfloat16), ("avx2", "fp32", torch.float32)]
)
def test_the_demos_mfu_is_against_the_peak_of_this_cpu_kind(
    simulate, tmp_path, monkeypatch, capsys, kind, chosen, dtype
):
    """``trainmesh demo``: the precision it picks on this kind of CPU, the peak it probes for that
    precision's compute dtype, and the MFU the Trainer's meter reports against that peak."""
    monkeypatch.setenv("TRAINMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "bf16_matmul_speedup", _untimed)
    other = "avx512_bf16"
    simulate(other)  # a peak of another kind of CPU is in the cache already
    (tmp_path / "peak_flops.json").write_text(json.dumps({throughput._key("cpu", dtype): 1e11}))
    simulate(kind)
    probed = []

    def probe(dtype, seconds=2.0, **options):  # the real probe, without its seconds of timing
        probed.append(dtype)
        cached = json.loads((tmp_path / "peak_flops.json").read_text())
        cached[throughput._key("cpu", dtype)] = 4e12
        (tmp_path / "peak_flops.json").write_text(json.dumps(cached))
        return 4e12

    monkeypatch.setattr(throughput, "measure_peak_flops", probe)
    args = demo_cmd._resolve_precision(_auto_demo_args())
    assert args.precision == chosen and f"[demo] precision {chosen}: " in capsys.readouterr().out
    demo_cmd._ensure_peak_probe(args.precision)
    assert probed == [dtype]  # the other CPU's peak was not taken for this one's
    demo_cmd._ensure_peak_probe(args.precision)
    assert probed == [dtype]  # this CPU's is, once probed
    meter = throughput.ThroughputMeter.for_job(
        peak_flops=None, dtype=dtype, device_type="cpu", world_size=4, local_world_size=4, meta_model=None
    )
    assert meter.peak_flops == 4e12 and meter.peak_units == 1
    meter.flops_per_sample = 1e9
    rates = meter.report(samples=100)
    assert rates["mfu"] == pytest.approx(rates["model_flops_per_s"] / 4e12)
