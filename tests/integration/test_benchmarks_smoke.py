"""Every benchmark script runs: each one's smallest path (``--smoke``, or its own flags at their minimum) end to
end, and its ``--json`` carries a top-level ``figures`` object with the names run_all.py merges. A change to
trainmesh that breaks a benchmark's use of it (issue 47: plan_accuracy.py's loss still took a bare tensor
after the pipeline's loss contract passed the model's output type) now fails the suite.

Nothing is timed or judged here: a smoke-size run on a shared machine says nothing about a figure.
Peers outside the test extra (accelerate, lightning-fabric, deepspeed: the ``bench`` extra) are left out,
with the reason, where they are not importable; trainmesh's side still runs. chaos.py and finetune.py
have their own tests (test_chaos.py, test_finetune_benchmark.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

pytestmark = [pytest.mark.dist]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")


def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


@dataclass
class Smoke:
    args: list[str]
    figures: list[str]
    needs: tuple[str, ...] = ("transformers",)  # what trainmesh's own side needs (the test extra has it)
    peers: dict = field(default_factory=dict)  # peer modules -> (args with them, extra figures, args without)
    timeout: int = 420  # seconds; about 5-50 s each on an idle 2-core machine, far more under load


SMOKES = {
    "ddp_overhead": Smoke(
        ["--rounds", "2", "--steps", "1", "--warmup", "0", "--batch", "8"], ["dataparallel_vs_ddp"], needs=()
    ),
    "trainer_overhead": Smoke(
        ["--rounds", "2", "--steps", "1", "--warmup", "0", "--batch", "8"],
        ["trainer_vs_hand_written_1proc"],
        needs=(),
        peers={
            ("accelerate", "lightning_fabric"): (
                [],
                ["trainer_vs_accelerate_2proc", "trainer_vs_fabric_2proc"],
                ["--parts", "single"],
            )
        },
    ),
    "zero_memory": Smoke(
        ["--quick", "--nproc", "2", "--stages", "0,3", "--steps", "1", "--mem-steps", "1", "--warmup", "0"],
        ["zero3_model_state_vs_formula"],
        peers={
            ("deepspeed",): (
                ["--systems", "trainmesh,deepspeed"],
                ["zero3_peak_vs_deepspeed", "zero3_step_vs_deepspeed"],
                ["--systems", "trainmesh"],
            )
        },
    ),
    "checkpoint": Smoke(["--rounds", "1", "--layers", "2", "--width", "256"], ["async_ckpt_block_vs_sync"], needs=()),
    "dataloader": Smoke(
        ["--rounds", "1", "--steps", "2", "--batch", "16", "--step-ms", "5"],
        ["data_wait_fraction", "data_wait_fraction_decode_workers"],
        needs=(),
    ),
    # the transport part (the figures'); its compression and straggler parts cost ~50 s of CPU more
    "ps": Smoke(
        ["--rounds", "1", "--repeats", "4", "--parts", "transport"],
        ["ps_push_1mb_vs_raw_zmq", "ps_sparse_push_vs_raw_zmq"],
        needs=("zmq",),
    ),
    "compression": Smoke(
        ["--rounds", "1", "--steps", "1", "--warmup", "0", "--nproc", "2", "--batch", "8"],
        ["int8_payload_reduction", "topk1_payload_reduction", "int8_final_loss_vs_fp32", "topk1_final_loss_vs_fp32"],
        needs=(),
    ),
    "tensor_parallel": Smoke(
        ["--rounds", "1", "--steps", "1", "--nproc", "2"],
        ["tp_step_vs_hand_written", "tp_collectives_per_block", "ac_full_saved_activations_vs_none"],
    ),
    "pipeline": Smoke(
        ["--smoke"],
        [
            "pp2_parity_max_abs_diff",
            "gpipe_bubble_vs_theory",
            "interleaved_bubble_vs_1f1b",
            "1f1b_peak_activations_vs_gpipe",
        ],
        needs=(),
    ),
    "plan_accuracy": Smoke(
        ["--smoke"],
        ["plan_memory_vs_measured_worst", "plan_comm_bytes_vs_counted_worst", "plan_step_time_vs_measured_worst"],
    ),
    "moe": Smoke(
        ["--quick", "--rounds", "1", "--steps", "1", "--warmup", "0"],
        [
            "moe_ep_step_vs_transformers_ep",
            "moe_ep_expert_state_vs_replicated",
            "moe_dispatch_bytes_vs_formula",
            "moe_ep_parity_max_abs_diff",
        ],
    ),
    "transformers_peer": Smoke(
        ["--smoke"], ["tp_step_vs_transformers_tp_2proc", "zero3_step_vs_transformers_fsdp_2proc"]
    ),
}
# Smoke runs past this test's share of the suite's time (each ~170 s of CPU on a 2-core machine, or root's
# network-namespace clusters): run with TRAINMESH_SLOW_BENCH_SMOKE=1 (run_all.py --quick runs them too).
SLOW = {
    # 6 process launches of 4 (3 loads, 2 first steps, the meta-init check)
    "big_model": Smoke(
        ["--smoke"],
        [
            "meta_load_peak_rss_vs_full_fp32",
            "hf_time_to_first_step_vs_transformers_distributed",
            "hf_load_time_vs_copy_limit",
            "save_pretrained_time_vs_transformers_save",
            "meta_init_layout_max_abs_diff",
        ],
        needs=("transformers", "safetensors", "accelerate"),
        timeout=900,
    ),
    # torch.compile of two models in 4 processes
    "throughput": Smoke(
        ["--quick", "--rounds", "1", "--steps", "1"],
        ["compiled_vs_eager_step_gpt", "compiled_vs_eager_step_llama_zero3", "compiled_parity_max_abs_diff"],
        timeout=900,
    ),
    "communication": Smoke(
        ["--quick", "--rounds", "1", "--steps", "1", "--skip-ssp"],
        ["hier_inter_host_bytes_vs_flat"],
        needs=(),
        timeout=900,
    ),
    # issue 43's context parallelism (its cost at --quick not measured here yet)
    "long_context": Smoke(
        ["--quick", "--rounds", "1"], ["cp_parity_max_abs_diff", "ring_vs_ulysses_step"], timeout=900
    ),
    # issue 45's: about 14 process starts and 2 real SIGKILLs (6 min at load 28)
    "replica_ft": Smoke(
        ["--quick"],
        [
            "ft_committed_steps_lost",
            "ft_time_lost_vs_restart",
            "ft_rejoin_identical_fraction",
            "ft_samples_exactly_once",
            "ft_step_overhead_no_fault",
        ],
        needs=("torchft",),
        timeout=900,
    ),
    "multihost": Smoke(
        ["--quick", "--rounds", "1", "--steps", "4"], ["dp_2hosts_parity_max_abs_diff"], needs=(), timeout=900
    ),
}
ROOT_ONLY = {"communication", "multihost"}
# Benchmarks whose smallest run is in another test, and where.
ELSEWHERE = {
    "chaos": "tests/integration/test_chaos.py runs chaos.py --quick --nproc 2",
    "finetune": "tests/integration/test_finetune_benchmark.py runs finetune.py --quick",
}
# Not benchmarks: the driver, the table renderer, and parts another benchmark imports (ps_embedding is
# ps.py's part "embedding", against TorchRec, which CI does not install; ds_ulysses is long_context.py's
# DeepSpeed side, run with its --deepspeed).
NOT_BENCHMARKS = {"run_all", "render_tables", "ssp_straggler", "ps_embedding", "ds_ulysses"}
# A benchmark split by concept: its parts (``<script>_<concept>.py``), imported by the script, not run alone.
NOT_BENCHMARKS |= {
    "zero_memory_setup",
    "zero_memory_instruments",
    "zero_memory_worker",
    "zero_memory_report",
    "chaos_job",
    "chaos_launch",
    "chaos_analysis",
    "plan_accuracy_setup",
    "plan_accuracy_measure",
    "plan_accuracy_plan",
    "plan_accuracy_compare",
    "communication_job",
    "communication_figures",
    "communication_ssp",
    "trainer_overhead_setup",
    "trainer_overhead_worker",
    "trainer_overhead_report",
    "finetune_sides",
    "finetune_workers",
    "finetune_parity",
    "finetune_report",
    "ps_transport",
    "ps_straggler",
}


def _scripts() -> set[str]:
    return {name[:-3] for name in os.listdir(BENCH) if name.endswith(".py")} - NOT_BENCHMARKS


def test_every_benchmark_has_a_smoke_run():
    """A new benchmark is listed here (or says where it is tested), and run_all.py knows it."""
    spec = importlib.util.spec_from_file_location("run_all", os.path.join(BENCH, "run_all.py"))
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    registered = {entry["name"] for entry in run_all.REGISTRY}
    unlisted = _scripts() - set(SMOKES) - set(ELSEWHERE) - set(SLOW)
    assert not unlisted, f"benchmarks without a smoke run in this test: {sorted(unlisted)}"
    assert _scripts() <= registered, f"benchmarks run_all.py does not run: {sorted(_scripts() - registered)}"


@pytest.mark.timeout(960)
@pytest.mark.parametrize("name", sorted(SMOKES) + sorted(SLOW))
def test_benchmark_smoke(name, tmp_path):
    smoke = SMOKES.get(name) or SLOW[name]
    if not os.path.exists(os.path.join(BENCH, f"{name}.py")):
        pytest.skip(f"benchmarks/{name}.py is not in this checkout")
    if name in SLOW and not os.environ.get("TRAINMESH_SLOW_BENCH_SMOKE"):
        pytest.skip(f"{name}: a slow smoke run (set TRAINMESH_SLOW_BENCH_SMOKE=1)")
    if name in ROOT_ONLY and os.geteuid() != 0:
        pytest.skip(f"{name}: needs root (network namespaces)")
    missing = [m for m in smoke.needs if not _have(m)]
    if missing:
        pytest.skip(f"{name}: trainmesh's side needs {missing}")
    args, figures, left_out = list(smoke.args), list(smoke.figures), []
    for modules, (with_them, their_figures, without) in smoke.peers.items():
        if _have(*modules):
            args += with_them
            figures += their_figures
        else:
            args += without
            left_out.append(f"{', '.join(modules)} not importable (the bench extra): their side is left out")
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, f"{name}.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=smoke.timeout,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 0, f"{name} {' '.join(args)}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert isinstance(report.get("figures"), dict), sorted(report)
    assert set(figures) <= set(report["figures"]), (figures, report["figures"])
    for key in figures:
        value = report["figures"][key]
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and value == value, (key, value)
    if left_out:
        print(f"{name}: " + "; ".join(left_out))
