"""zero_memory.py's report: the ZeRO model-state formulas, the one each variant is compared with, the
summary over rounds and ranks (the figures, their validity) and the printed table.

It exists apart from the script because it reads finished runs only: the figures' definitions, in one place.
"""

from __future__ import annotations

import math
import statistics

import torch

from trainmesh.testing.stats import ci95

from zero_memory_setup import DS_CHANGES, HOST_MALLOC, MODEL_STATE_TOLERANCE, PRECISIONS


# --------------------------------------------------------------------------- formulas and report
def formulas(num_params: int, n: int, stage: int) -> dict[str, float]:
    """Per-rank model-state bytes. ``paper``: 2P (bf16 params) + 2P (bf16 grads) + 12P (fp32 master,
    m, v), divided as ZeRO stage ``stage`` says. ``fp32``: the same for a system that keeps its
    parameters and gradients in fp32 (master = the parameters): 4P + 4P + 8P (m, v)."""
    p = float(num_params)
    paper = {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}[stage]
    fp32 = {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}[stage]
    return {"paper_2_2_12": paper, "fp32_4_4_8": fp32, "fp32_all_sharded": 16 * p / n}


def matching_formula(system: str, stage: int, precision: str = "bf16-mixed") -> tuple[str, str]:
    """Which formula describes what the system stores, and why. trainmesh stores the same under
    bf16-mixed and fp32 (fp32 parameters are its master copy; bf16 exists only under autocast)."""
    if system == "deepspeed":
        if precision == "fp32":
            return "fp32_4_4_8", (
                "fp32 params + fp32 grads + m/v"
                + (
                    "; stages 1-2 also keep an fp32 master partition (a clone, 4P/N) beside the fp32 params, and "
                    "stage 1 holds only the gradient partition, as stage 2 does"
                    if stage in (1, 2)
                    else ""
                )
            )
        return "paper_2_2_12", "bf16 params + bf16 grads + fp32 master/m/v (the paper's mixed precision)"
    if stage in (1, 2):
        return "fp32_all_sharded", (
            "fp32 params + grads + m/v, all sharded: FSDP2 keeps parameters sharded "
            "between steps at stages 1-2 too (gathered only from forward to backward)"
        )
    return "fp32_4_4_8", "fp32 params (the master copy) + fp32 grads + m/v (bf16 only under autocast)"


def summarize(runs: dict[str, list[list[dict]]], cfg: dict) -> dict:
    n = cfg["nproc"]
    settings = PRECISIONS[cfg["precision"]]
    zero_key, loss_tolerance = settings["zero_formula"], settings["loss_tolerance"]
    variants = {}
    for variant, rounds in runs.items():
        system, stage = variant.rsplit("-", 1)
        stage = int(stage)
        ranks = rounds[0]
        num_params = ranks[0]["num_params"]
        ms_bytes = [r["model_state_bytes"] for r in ranks]
        forms = formulas(num_params, n, stage)
        key, why = matching_formula(system, stage, cfg["precision"])
        # per step: the slowest rank (barrier-to-barrier, so all ranks agree closely); timed steps only
        timed, round_medians = [], []
        for ranks_r in rounds:
            per_step = [max(s) for s in zip(*(r["step_times_s"] for r in ranks_r))]
            timed.extend(per_step[cfg["mem_steps"] + cfg["warmup"] :])
            if per_step[cfg["mem_steps"] + cfg["warmup"] :]:
                round_medians.append(statistics.median(per_step[cfg["mem_steps"] + cfg["warmup"] :]))
        hwm_delta = [(r["vm_hwm_kb"] - r["rss_after_setup_kb"]) * 1024 for ranks_r in rounds for r in ranks_r]
        # CPU seconds per timed step, summed over the ranks (the work done, whatever the machine's load)
        skip = cfg["mem_steps"] + cfg["warmup"]
        cpu = [sum(s) for ranks_r in rounds for s in list(zip(*(r.get("step_cpu_s", []) for r in ranks_r)))[skip:]]
        variants[variant] = {
            "system": system,
            "stage": stage,
            "num_params": num_params,
            "peak_live_bytes_max_rank": max(r["peak_live_bytes"] for rr in rounds for r in rr),
            "peak_live_bytes_per_rank": [[r["peak_live_bytes"] for r in rr] for rr in rounds],
            "live_after_setup_bytes_max_rank": max(r["live_after_setup_bytes"] for rr in rounds for r in rr),
            "rss_hwm_delta_bytes_max_rank": max(hwm_delta),
            "rss_hwm_delta_bytes_per_rank": hwm_delta,
            "model_state_bytes_max_rank": max(ms_bytes),
            "model_state_bytes_per_rank": ms_bytes,
            "model_state_parts_rank0": ranks[0]["model_state"],
            "formulas_bytes": forms,
            "matching_formula": key,
            "matching_formula_why": why,
            "model_state_vs_matching": max(ms_bytes) / forms[key],
            "model_state_vs_paper": max(ms_bytes) / forms["paper_2_2_12"],
            # the ZeRO formula for the run's precision (the paper's 2+2+12 under bf16-mixed, 4+4+8 under fp32)
            "zero_formula": zero_key,
            "model_state_vs_zero_formula": max(ms_bytes) / forms[zero_key],
            "step_time_median_s": statistics.median(timed) if timed else math.nan,
            "step_times_s": timed,
            "step_time_round_medians_s": round_medians,
            "step_cpu_s_all_ranks_median": statistics.median(cpu) if cpu else math.nan,
            "first_loss": ranks[0]["losses"][0] if ranks[0]["losses"] else math.nan,
            "last_loss": ranks[0]["losses"][-1] if ranks[0]["losses"] else math.nan,
            "wrapped": ranks[0]["wrapped"],
            "optimizer": ranks[0]["optimizer"],
        }
    comparisons = []
    for stage in (1, 2, 3):
        a, b = variants.get(f"trainmesh-{stage}"), variants.get(f"deepspeed-{stage}")
        if a and b:
            peak = a["peak_live_bytes_max_rank"] / b["peak_live_bytes_max_rank"]
            pooled = a["step_time_median_s"] / b["step_time_median_s"]
            # Rounds are interleaved (the two systems back to back, order alternating): the spread of
            # the per-round ratios is the comparison's noise. Peak memory repeats exactly per round.
            per_round = [x / y for x, y in zip(a["step_time_round_medians_s"], b["step_time_round_medians_s"])]
            # The figure is the median of the per-round ratios: each compares steps taken minutes apart
            # under the same load. A ratio of pooled medians can pair one side's quiet round with the
            # other's loaded one (a full run read 0.599 pooled against per-round 0.919 / 0.912 / 0.599).
            step = statistics.median(per_round) if len(per_round) >= 2 else pooled
            same = abs(a["first_loss"] - b["first_loss"]) <= loss_tolerance * abs(b["first_loss"])
            comparisons.append(
                {
                    "stage": stage,
                    "peak_ratio": peak,
                    "peak_met": peak <= 1.0,
                    "same_work": same,
                    "first_loss_rel_diff": abs(a["first_loss"] - b["first_loss"]) / abs(b["first_loss"]),
                    "first_loss_tolerance": loss_tolerance,
                    "first_loss_trainmesh": a["first_loss"],
                    "first_loss_deepspeed": b["first_loss"],
                    "rss_delta_ratio": a["rss_hwm_delta_bytes_max_rank"] / b["rss_hwm_delta_bytes_max_rank"],
                    "step_ratio": step,
                    "step_ratio_pooled_medians": pooled,
                    "step_met": step <= 1.0,
                    "cpu_ratio": a["step_cpu_s_all_ranks_median"] / b["step_cpu_s_all_ranks_median"],
                    "step_ratio_per_round": per_round,
                    "step_ratio_round_ci95": ci95(per_round) if len(per_round) > 1 else None,
                }
            )
    state_checks = [
        {
            "variant": v,
            "ratio": s["model_state_vs_matching"],
            "formula": s["matching_formula"],
            "met": abs(s["model_state_vs_matching"] - 1) <= MODEL_STATE_TOLERANCE,
        }
        for v, s in variants.items()
        if s["system"] == "trainmesh"
    ]
    figures = {}
    for c in comparisons:
        figures[f"zero{c['stage']}_peak_vs_deepspeed"] = c["peak_ratio"]
        figures[f"zero{c['stage']}_step_vs_deepspeed"] = c["step_ratio"]
    for c in state_checks:
        stage = variants[c["variant"]]["stage"]
        if stage in (1, 2, 3):
            figures[f"zero{stage}_model_state_vs_formula"] = c["ratio"]
    return {
        "variants": variants,
        "comparisons": comparisons,
        "model_state_checks": state_checks,
        "figures": figures,
        "precision": cfg["precision"],
        "precision_why": cfg["precision_why"],
        "deepspeed_changes": DS_CHANGES,
        "trainmesh_settings": settings["tm_settings"],
        "valid": all(c["same_work"] for c in comparisons),
        "targets": {"model_state_within": MODEL_STATE_TOLERANCE, "peak_ratio_max": 1.0, "step_ratio_max": 1.0},
        "config": cfg,
        "torch_version": torch.__version__,
    }


def print_report(report: dict) -> None:
    cfg, mb = report["config"], 2**20
    vs = report["variants"]
    tag_of = {"fp32_4_4_8": "F", "fp32_all_sharded": "S", "paper_2_2_12": "Z"}
    any_v = next(iter(vs.values()))
    m = cfg["model"]
    print(
        f"GPT {any_v['num_params'] / 1e6:.2f}M params ({m['n_layer']} blocks, d {m['d_model']}, vocab {m['vocab']}, "
        f"seq {m['seq']}), {cfg['nproc']} processes (gloo, CPU), {PRECISIONS[cfg['precision']]['what']}, global batch "
        f"{cfg['batch']}, {cfg['rounds']} round(s) x ({cfg['mem_steps']} memory + {cfg['warmup']} warmup + "
        f"{cfg['steps']} timed steps), load avg {report['load_avg_1min']['before']:.2f} -> "
        f"{report['load_avg_1min']['after']:.2f}"
    )
    print(f"precision {cfg['precision']} on both sides ({cfg['precision_why']})")
    zero_key = PRECISIONS[cfg["precision"]]["zero_formula"]
    print(
        "MB per rank (max over ranks). model state = params + grads + optimizer state held; formula = the ZeRO "
        "formula for what that system stores (F: fp32 4P+4P+8P, S: fp32 all sharded, Z: paper 2P+2P+12P); "
        f"zero = the ZeRO formula for {cfg['precision']} ({tag_of[zero_key]})"
    )
    header = (
        f"{'variant':<13}{'params':>8}{'grads':>8}{'optim':>8}{'state':>8}{'formula':>10}{'ratio':>7}"
        f"{'zero':>8}{'peak live':>11}{'RSS delta':>11}{'step s':>8}{'loss 1st':>10}"
    )
    print(header)
    print("-" * len(header))
    tag = tag_of
    for name in sorted(vs, key=lambda v: (vs[v]["stage"], vs[v]["system"] != "trainmesh")):
        s = vs[name]
        parts = s["model_state_parts_rank0"]
        f = s["formulas_bytes"][s["matching_formula"]]
        print(
            f"{name:<13}{parts.get('params', 0) / mb:>8.1f}{parts.get('grads', 0) / mb:>8.1f}"
            f"{parts.get('optimizer', 0) / mb:>8.1f}{s['model_state_bytes_max_rank'] / mb:>8.1f}"
            f"{f / mb:>8.1f} {tag[s['matching_formula']]}{s['model_state_vs_matching']:>7.3f}"
            f"{s['formulas_bytes'][zero_key] / mb:>8.1f}{s['peak_live_bytes_max_rank'] / mb:>11.1f}"
            f"{s['rss_hwm_delta_bytes_max_rank'] / mb:>11.1f}{s['step_time_median_s']:>8.3f}{s['first_loss']:>10.4f}"
        )
    quick = " (--quick: smoke test, too few steps to judge)" if cfg["quick"] else ""
    for c in report["model_state_checks"]:
        print(
            f"model state {c['variant']}: {c['ratio']:.3f} x formula {c['formula']}, target within "
            f"{MODEL_STATE_TOLERANCE:.0%}: {'met' if c['met'] else 'NOT MET'}"
        )
    if report["comparisons"]:
        print(
            "trainmesh runs with its defaults" + (" except (change: reason):" if report["trainmesh_settings"] else "")
        )
        for key, why in report["trainmesh_settings"].items():
            print(f"  {key}: {why}")
        print("DeepSpeed runs with its defaults except (change: reason):")
        for key, why in report["deepspeed_changes"].items():
            print(f"  {key}: {why}")
        eff = {
            n: v[0][0].get("ds_overlap_comm_effective")
            for n, v in report["raw_per_rank"].items()
            if n.startswith("deepspeed")
        }
        print(f"  overlap_comm (DeepSpeed's default, effective): {eff}")
        comm = {
            n: v[0][0].get("ds_communication_data_type")
            for n, v in report["raw_per_rank"].items()
            if n.startswith("deepspeed")
        }
        print(f"  communication_data_type (DeepSpeed's default for the precision, effective): {comm}")
        malloc = sorted({r.get("host_malloc") for v in report["raw_per_rank"].values() for r in v[0]} - {None})
        print(f"both sides: {HOST_MALLOC}; effective: {malloc}")
    for c in report["comparisons"]:
        if not c["same_work"]:
            print(
                f"INVALID stage {c['stage']}: first losses differ ({c['first_loss_trainmesh']:.6f} vs "
                f"{c['first_loss_deepspeed']:.6f}, relative {c['first_loss_rel_diff']:.1e}, tolerance "
                f"{c['first_loss_tolerance']:g}): the sides did different work"
            )
        print(
            f"stage {c['stage']}: first-step losses {c['first_loss_trainmesh']:.6f} vs {c['first_loss_deepspeed']:.6f} "
            f"(relative {c['first_loss_rel_diff']:.1e}, must be <= {c['first_loss_tolerance']:g})"
        )
        print(
            f"stage {c['stage']}: peak live trainmesh/deepspeed = {c['peak_ratio']:.3f} (<= 1: "
            f"{'met' if c['peak_met'] else 'NOT MET'}; RSS delta ratio {c['rss_delta_ratio']:.3f}), step time "
            f"= {c['step_ratio']:.3f} (median of per-round ratios; of pooled medians "
            f"{c['step_ratio_pooled_medians']:.3f}){_interval(c.get('step_ratio_round_ci95'))} (<= 1: "
            f"{'met' if c['step_met'] else 'NOT MET'}; CPU seconds per step, all ranks: {c['cpu_ratio']:.3f}){quick}"
        )


def _interval(bounds) -> str:
    return f" [95% of rounds {bounds[0]:.3f}-{bounds[1]:.3f}]" if bounds else ""
