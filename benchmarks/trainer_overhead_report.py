"""trainer_overhead.py's report: a part's summary over rounds and processes (per-variant step times, the
ratios and their confidence intervals, the same-work check) and its printed table.

It exists apart from the script because it reads finished runs only: the figures' definitions, in one place.
"""

from __future__ import annotations

import statistics


from trainmesh.testing.stats import median_ci95

from trainer_overhead_setup import COMPARISONS, MULTI, PARAM_TOLERANCE, SINGLE


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def summarize(results: list[dict], cfg: dict, part: str) -> dict:
    variants = SINGLE if part == "single" else MULTI
    rounds_n, steps = cfg["rounds"], cfg["steps"]
    summary = {}
    for name in variants:
        # Per round: the timed block from barrier to barrier, per step (every process leaves the
        # closing barrier together, so the max over processes is the slowest one's time). This is
        # the figure the ratios use: a step-by-step max over processes would favour a variant that
        # synchronises the processes at the end of every step (the Trainer's loss all-reduce),
        # because unsynchronised processes split scheduling noise over different steps.
        round_ms = [1e3 * max(res["walls"][name][r] for res in results) / steps for r in range(rounds_n)]
        # Per step (as ddp_overhead.py): each step as slow as its slowest process; for the spread.
        per_step = [
            [1e3 * max(step) for step in zip(*(res["times"][name][r] for res in results))] for r in range(rounds_n)
        ]
        pooled = [t for rnd in per_step for t in rnd]
        r1, r3 = _quartiles(round_ms)
        s1, s3 = _quartiles(pooled)
        summary[name] = {
            "median_ms": statistics.median(round_ms),
            "round_p25_ms": r1,
            "round_p75_ms": r3,
            "round_ms": round_ms,
            "step_median_ms": statistics.median(pooled),
            "step_p25_ms": s1,
            "step_p75_ms": s3,
            "per_step_ms": per_step,
            "steps": len(pooled),
        }
    diffs = {name: max(res["max_abs_diff"][name] for res in results) for name in variants}
    diff = max(diffs.values())
    params_match = diff <= PARAM_TOLERANCE and all(res["finite"] for res in results)
    comparisons = []
    for num, den, target, role in COMPARISONS[part]:
        a, b = summary[num], summary[den]
        # Both sides ran in the same round, minutes apart at most: their ratio cancels slow drift.
        round_ratios = [p / q for p, q in zip(a["round_ms"], b["round_ms"])]
        ratio = a["median_ms"] / b["median_ms"]
        comparisons.append(
            {
                "numerator": num,
                "denominator": den,
                "role": role,
                "ratio": ratio,
                "round_ratios": round_ratios,
                "ratio_round_median": statistics.median(round_ratios),
                # How far the noise alone moves the per-round figure: a 95% bootstrap interval over rounds.
                "ratio_round_median_ci95": list(median_ci95(round_ratios)),
                "ratio_step_median": a["step_median_ms"] / b["step_median_ms"],
                # Load from other programs only ever adds time, so the fast quartile is the least disturbed.
                "ratio_step_p25": a["step_p25_ms"] / b["step_p25_ms"],
                "target": target,
                # A ratio of unequal work proves nothing; diagnostics have no target.
                "met": None if target is None else ratio <= target and params_match,
            }
        )
    return {
        "part": part,
        "world_size": len(results),
        "variants": summary,
        "round_order": results[0]["orders"],
        "comparisons": comparisons,
        "max_abs_param_diff": diff,
        "max_abs_param_diff_by_variant": diffs,
        "param_reference": variants[0],
        "max_param_change_from_init": max(res["max_change_from_init"] for res in results),
        "params_match": params_match,
        "param_tolerance": PARAM_TOLERANCE,
        "trainer_output_rank0": results[0]["trainer_output"],
        "warnings_rank0": results[0]["warnings"],
        "torch_threads": [res["torch_threads"] for res in results],
    }


def print_part(report: dict, title: str, quick: bool) -> None:
    print(title)
    header = (
        f"{'variant':<18}{'ms/step':>9}{'rounds IQR':>15}{'rounds min-max':>17}"
        f"{'step median':>13}{'step IQR':>15}{'steps':>7}"
    )
    print(header)
    print("-" * len(header))
    for name, s in report["variants"].items():
        rounds_iqr = f"{s['round_p25_ms']:.2f}-{s['round_p75_ms']:.2f}"
        rounds_range = f"{min(s['round_ms']):.2f}-{max(s['round_ms']):.2f}"
        step_iqr = f"{s['step_p25_ms']:.2f}-{s['step_p75_ms']:.2f}"
        print(
            f"{name:<18}{s['median_ms']:>9.2f}{rounds_iqr:>15}{rounds_range:>17}"
            f"{s['step_median_ms']:>13.2f}{step_iqr:>15}{s['steps']:>7}"
        )
    for c in report["comparisons"]:
        if c["target"] is None:
            verdict = "diagnostic, no target"
        else:
            verdict = "MET" if c["met"] else "NOT MET" if report["params_match"] else "INVALID (parameters differ)"
            verdict = f"target <= {c['target']:.2f}: {verdict}" + (
                " (--quick: too few steps to judge)" if quick else ""
            )
            verdict += f" [{c['role']}]"
        low, high = c["ratio_round_median_ci95"]
        print(
            f"{c['numerator']} / {c['denominator']} = {c['ratio']:.4f}, {verdict}"
            f"\n    median of per-round ratios {c['ratio_round_median']:.4f} (95% CI {low:.3f}-{high:.3f}); "
            f"per-step medians {c['ratio_step_median']:.4f}, per-step p25s {c['ratio_step_p25']:.4f}"
        )
    if report["params_match"]:
        print(
            f"parameters agree after equal steps: max |diff| vs {report['param_reference']} = "
            f"{report['max_abs_param_diff']:.3g} (tolerance {report['param_tolerance']:g}; "
            f"max change from init {report['max_param_change_from_init']:.3g})"
        )
    else:
        print(
            "!" * 78 + f"\n!!! PARAMETERS DIFFER (or are not finite): max |diff| by variant = "
            f"{report['max_abs_param_diff_by_variant']} > {report['param_tolerance']:g}."
            "\n!!! The variants did not do the same work; the timing comparison is NOT valid.\n" + "!" * 78
        )
