"""Render the benchmark tables in benchmarks/README.md and README.md from benchmarks/results/latest.json.

    python benchmarks/render_tables.py           # rewrite the generated blocks in place
    python benchmarks/render_tables.py --check   # exit 1 if a README differs from what this renders

The tables live between ``<!-- BEGIN GENERATED ... -->`` and ``<!-- END GENERATED ... -->`` marker
lines, stamped with the results file's commit, date and mode, so they cannot silently go stale:
tests/unit/test_benchmark_tables.py fails when a README differs from what this script renders.
Every number comes from the results file; only targets and the known reasons for a miss are here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "latest.json")
BENCH_README = os.path.join(HERE, "README.md")
TOP_README = os.path.join(ROOT, "README.md")

# figure -> (target text, test: value -> met): the goals the issues fixed; a figure not here is reported
# without a target.
TARGETS = {
    "dataparallel_vs_ddp": ("<= 1.03", lambda v: v <= 1.03),
    "trainer_vs_hand_written_1proc": ("<= 1.02", lambda v: v <= 1.02),
    "trainer_vs_accelerate_2proc": ("<= 1.00", lambda v: v <= 1.00),
    "trainer_vs_fabric_2proc": ("<= 1.00", lambda v: v <= 1.00),
    **{f"zero{k}_peak_vs_deepspeed": ("<= 1.00", lambda v: v <= 1.00) for k in (1, 2, 3)},
    **{f"zero{k}_step_vs_deepspeed": ("<= 1.00", lambda v: v <= 1.00) for k in (1, 2, 3)},
    **{f"zero{k}_model_state_vs_formula": ("1.00 +- 0.10", lambda v: abs(v - 1) <= 0.10) for k in (1, 2, 3)},
    "planner_vs_measured_peak": ("1.00 +- 0.15", lambda v: abs(v - 1) <= 0.15),
    "async_ckpt_block_vs_sync": ("<= 0.10", lambda v: v <= 0.10),
    "data_wait_fraction": ("<= 0.05", lambda v: v <= 0.05),
    "ps_push_1mb_vs_raw_zmq": (">= 0.50", lambda v: v >= 0.50),
    # issue 14's (pipeline.py)
    "pp2_parity_max_abs_diff": ("<= 1e-05", lambda v: v <= 1e-5),
    "hybrid_3d_parity_max_abs_diff": ("<= 1e-05", lambda v: v <= 1e-5),
    "gpipe_bubble_vs_theory": ("0.80 - 1.25", lambda v: 0.8 <= v <= 1.25),
    "interleaved_bubble_vs_1f1b": ("< 1", lambda v: v < 1),
    "1f1b_peak_activations_vs_gpipe": ("<= 0.75", lambda v: v <= 0.75),
    # issue 12's (tensor_parallel.py)
    "tp_step_vs_hand_written": ("<= 1.03", lambda v: v <= 1.03),
    "tp_collectives_per_block": ("<= 4", lambda v: v <= 4),
    # issue 15's (multihost.py); dp_2hosts_step_vs_1host is reported for context, no target
    "dp_2hosts_parity_max_abs_diff": ("<= 1e-06", lambda v: v <= 1e-6),
    "host_kill_resume_identical": ("1", lambda v: v == 1),
    "host_kill_lost_steps": ("<= 3", lambda v: v <= 3),
    # issue 16's (communication.py)
    "hier_inter_host_bytes_vs_flat": ("<= 0.70", lambda v: v <= 0.7),
    "hier_step_vs_flat_100mbit": ("<= 0.80", lambda v: v <= 0.8),
    "int8_wire_bytes_reduction_2x4": (">= 3.5", lambda v: v >= 3.5),
    "topk1_wire_bytes_reduction_2x4": (">= 10", lambda v: v >= 10),
    "int8_step_vs_fp32_100mbit": ("<= 0.50", lambda v: v <= 0.5),
    "powersgd_step_vs_fp32_100mbit": ("<= 0.30", lambda v: v <= 0.3),
    "auto_step_vs_best_fixed_100mbit": ("<= 1.10", lambda v: v <= 1.1),
    "auto_step_vs_best_fixed_unshaped": ("<= 1.10", lambda v: v <= 1.1),
    "ssp_time_to_loss_vs_sync_straggler_host": ("<= 0.80", lambda v: v <= 0.8),
    "powersgd_final_loss_vs_fp32": ("<= 1.02", lambda v: v <= 1.02),
    "int8_final_loss_vs_fp32": ("<= 1.02", lambda v: v <= 1.02),  # also compression.py's (issue 13)
    "topk1_final_loss_vs_fp32": ("<= 1.02", lambda v: v <= 1.02),  # issue 16's "within 2% of fp32"
    # issue 17's (plan_accuracy.py)
    "plan_memory_vs_measured_worst": ("0.85 - 1.15", lambda v: 0.85 <= v <= 1.15),
    "plan_comm_bytes_vs_counted_worst": ("0.99 - 1.01", lambda v: 0.99 <= v <= 1.01),
    "plan_step_time_vs_measured_worst": ("0.75 - 1.33", lambda v: 0.75 <= v <= 1.33),
    # issue 18's (throughput.py)
    "compiled_vs_eager_step_gpt": ("<= 0.90", lambda v: v <= 0.9),
    "compiled_vs_eager_step_llama_zero3": ("<= 1.00", lambda v: v <= 1.0),
    "compiled_parity_max_abs_diff": ("<= 1e-05", lambda v: v <= 1e-5),
    "demo_mfu_vs_bf16_peak": (">= 0.30", lambda v: v >= 0.3),
    # the same goal where the demo runs in fp32 (a CPU without native bf16 matmuls): against the fp32 peak
    "demo_mfu_vs_fp32_peak": (">= 0.30", lambda v: v >= 0.3),
}
# The fixed names, in the order the table lists them (others follow alphabetically).
ORDER = list(TARGETS) + ["int8_payload_reduction", "topk1_payload_reduction", "int8_wire_bytes_reduction",
                         "topk1_wire_bytes_reduction"]
# Why a target is missed, where a measurement shows the cause (shown only on a miss).
REASONS = {
    "trainer_vs_hand_written_1proc": "steps of ~30 ms on a shared machine: quick runs (12 rounds x 4 steps) of one "
                                     "commit read 0.88-1.11; the last full run (50 x 6) read 0.994",
    "trainer_vs_accelerate_2proc": "full runs (50 rounds x 6 steps) read 1.019 (95% 0.970-1.044) vs Accelerate and "
                                   "1.026 (1.015-1.057) vs Fabric: about 1 ms of a ~46 ms two-process step that the "
                                   "Trainer's per-step Python and its per-step check all-reduce (launched beside "
                                   "backward) do not account for; the cause is not found",
    "trainer_vs_fabric_2proc": "as trainer_vs_accelerate_2proc: a real gap of ~1 ms per two-process step in full runs "
                               "(1.026, 95% 1.015-1.057), cause not found",
    "zero1_step_vs_deepspeed": "at the quick model's size FSDP2's per-unit Python hooks and the copy-out of "
                               "gathered parameters are a fixed CPU cost per step (11-23% more CPU than DeepSpeed); "
                               "the full model absorbs it",
    "zero2_step_vs_deepspeed": "as zero1_step: per-unit FSDP2 hook cost at the quick model's size",
    "gpipe_bubble_vs_theory": "on CPU each microbatch's send/recv and the schedule's Python cost a fixed time "
                              "that theory's (p-1)/(m+p-1) does not count; tiny microbatches make it dominate",
    "interleaved_bubble_vs_1f1b": "interleaving halves the theoretical bubble but doubles the messages, whose fixed "
                                  "cost on gloo/CPU eats the gain at this size",
    "ps_push_1mb_vs_raw_zmq": "CPU per push, per OS thread on a quiet machine: 1.2-1.9 ms (client: caller 0.1, "
                              "PS I/O thread 0.25-0.4, ZeroMQ I/O 0.3-0.45, pyzmq's buffer release 0.05; server: "
                              "receive, decode, the SGD add of the 1 MB just received, the ack 0.35-0.5, ZeroMQ "
                              "I/O 0.2-0.35) against 0.86 ms for a raw echo that applies nothing; on 2 shared "
                              "cores CPU decides. Long runs (4 x 150 pushes) read 0.43-0.47",
    "compiled_vs_eager_step_gpt": "on this CPU the matmuls (~72% of the step) run the same kernels compiled or "
                                  "not; inductor fuses the rest (norms, GELU, softmax, residuals). Quick runs "
                                  "(2 rounds x 3 steps) of one commit read 0.88-1.04",
    "demo_mfu_vs_bf16_peak": "4 processes time-share 2 cores with DDP's gloo all-reduce; one process on one thread "
                             "runs the model at ~40% of a core's bf16 peak (small matmuls, casts); measured against "
                             "a ceiling load cannot lower (CPU-time probe)",
    "powersgd_step_vs_fp32_100mbit": "8 processes on 2 cores: the factors' all-reduces wait for peers the scheduler "
                                     "set aside; exchanging them between host leaders only read 0.27-0.29 in "
                                     "interleaved A/B runs (0.47-0.73 before), 2 hosts x 2 reads 0.15-0.21",
    "demo_mfu_vs_fp32_peak": "4 processes time-share 2 cores with DDP's gloo all-reduce; measured against a ceiling "
                             "load cannot lower (CPU-time probe)",
    "dataparallel_vs_ddp": "noise at the quick length: three quick runs of one commit read 1.15, 1.15 and 1.03; "
                           "the full run on the same commit read 1.005 (per-round 95% 0.98-1.05)",
    "plan_step_time_vs_measured_worst": "the plan prices the work within 10-25%; load that moves faster than the "
                                        "core-sharing probe can follow, and waits at collectives for descheduled "
                                        "peers at 4-8 processes on 2 cores, are not in it",
}


def ci95(results: dict, name: str):
    """The 95% bootstrap interval of the median per-round ratio, where the benchmark reports one."""
    runs = results.get("benchmarks", {})
    detail = (runs.get("ddp_overhead") or {}).get("detail") or {}
    if name == "dataparallel_vs_ddp" and detail.get("ratio_round_median_ci95"):
        return detail["ratio_round_median_ci95"]
    if name.startswith("zero") and name.endswith("_step_vs_deepspeed"):
        detail = (runs.get("zero_memory") or {}).get("detail") or {}
        for c in detail.get("comparisons", []):
            if f"zero{c['stage']}_step_vs_deepspeed" == name:
                return c.get("step_ratio_round_ci95")
    peers = {"trainer_vs_hand_written_1proc": ("single", "hand-written"),
             "trainer_vs_accelerate_2proc": ("multi", "accelerate"), "trainer_vs_fabric_2proc": ("multi", "fabric")}
    if name in peers:
        part, den = peers[name]
        detail = (runs.get("trainer_overhead") or {}).get("detail") or {}
        for c in detail.get("parts", {}).get(part, {}).get("comparisons", []):
            if c["numerator"] == "trainmesh" and c["denominator"] == den:
                return c.get("ratio_round_median_ci95")
    return None


# Figures the top-level README quotes (a short block), in this order.
TOP_FIGURES = ["dataparallel_vs_ddp", "trainer_vs_hand_written_1proc", "trainer_vs_accelerate_2proc",
               "trainer_vs_fabric_2proc", "zero1_peak_vs_deepspeed", "zero2_peak_vs_deepspeed",
               "zero3_peak_vs_deepspeed", "zero1_step_vs_deepspeed", "zero2_step_vs_deepspeed",
               "zero3_step_vs_deepspeed", "planner_vs_measured_peak", "async_ckpt_block_vs_sync",
               "data_wait_fraction", "ps_push_1mb_vs_raw_zmq"]


def _fmt(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"


def stamp(results: dict) -> str:
    mode = results.get("mode", "?")
    note = " (--quick: smoke runs, too few steps to judge a target)" if mode == "quick" else ""
    load = results.get("load_avg_start", [None])[0]
    load_text = f", load average {load:.2f} at start" if isinstance(load, (int, float)) else ""
    dirty = " + uncommitted changes" if results.get("dirty") else ""
    m = results.get("machine", {})
    return (f"From `benchmarks/results/latest.json`: commit {results.get('commit', '?')}{dirty}, "
            f"{results.get('date', '?')}, mode {mode}{note}; {m.get('cpu_count', '?')} cores ({m.get('cpu', '?')}), "
            f"{m.get('gpu', '?')}{load_text}; torch {results.get('versions', {}).get('torch', '?')}.")


def verdict(name: str, value, quick: bool) -> tuple[str, str]:
    if name not in TARGETS:
        return "-", "-"
    target, test = TARGETS[name]
    met = test(value)
    text = "met" if met else "NOT MET"
    if quick:
        text += " (quick)"
    return target, text


def figure_rows(results: dict, names: list[str]) -> list[str]:
    quick = results.get("mode") == "quick"
    figures, sources = results.get("figures", {}), results.get("figure_sources", {})
    rows = ["| figure | value | 95% CI (per-round ratios) | target | verdict | from | reason for a miss |",
            "|---|---|---|---|---|---|---|"]
    for name in names:
        if name not in figures:
            continue
        target, text = verdict(name, figures[name], quick)
        reason = REASONS.get(name, "") if "NOT MET" in text else ""
        ci = ci95(results, name)
        ci_text = f"{_fmt(ci[0])}-{_fmt(ci[1])}" if ci else "-"
        rows.append(f"| `{name}` | {_fmt(figures[name])} | {ci_text} | {target} | {text} | {sources.get(name, '?')} "
                    f"| {reason} |")
    return rows


def render_bench(results: dict) -> str:
    figures = results.get("figures", {})
    names = [n for n in ORDER if n in figures] + sorted(n for n in figures if n not in ORDER)
    lines = [stamp(results), "", *figure_rows(results, names), ""]
    missing = [n for n in ORDER if n not in figures]
    if missing:
        lines += [f"Not in this results file: {', '.join(f'`{n}`' for n in missing)} (see the runs below).", ""]
    lines += ["| benchmark | status | seconds | load before | note |", "|---|---|---|---|---|"]
    for name, run in results.get("benchmarks", {}).items():
        status = run.get("status", "?")
        load = run.get("load_avg_before")
        note = run.get("reason", "") if status == "skipped" else ("parameters or losses differ: figures withheld"
                                                                  if status == "invalid" else
                                                                  f"exit {run.get('exit_code')}" if status == "failed" else "")
        lines.append(f"| `{name}` | {status} | {_fmt(run['seconds']) if 'seconds' in run else '-'} | "
                     f"{_fmt(load[0]) if load else '-'} | {note} |")
    return "\n".join(lines)


def render_top(results: dict) -> str:
    return "\n".join([stamp(results), "", *figure_rows(results, TOP_FIGURES),
                      "", "Every figure, and how each is measured: `benchmarks/README.md`."])


BLOCKS = {BENCH_README: ("results", render_bench), TOP_README: ("benchmark-figures", render_top)}


def replace_block(text: str, tag: str, body: str) -> str:
    begin = f"<!-- BEGIN GENERATED {tag}: python benchmarks/render_tables.py -->"
    end = f"<!-- END GENERATED {tag} -->"
    if begin not in text or end not in text:
        raise ValueError(f"markers for {tag!r} not found: expected lines {begin!r} and {end!r}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def rendered(path: str, results: dict) -> str:
    tag, render = BLOCKS[path]
    with open(path) as fh:
        return replace_block(fh.read(), tag, render(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    parser.add_argument("--results", default=RESULTS, help="the results file (default benchmarks/results/latest.json)")
    args = parser.parse_args(argv)
    with open(args.results) as fh:
        results = json.load(fh)
    stale = []
    for path in BLOCKS:
        new = rendered(path, results)
        with open(path) as fh:
            old = fh.read()
        if new != old:
            stale.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w") as fh:
                    fh.write(new)
    if args.check and stale:
        print(f"stale tables in {stale}: run python benchmarks/render_tables.py", file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(stale)) if stale and not args.check else "tables up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
