"""communication.py's figures: each layout's summary over rounds (step time and inter-host bytes per
variant, with confidence intervals), the printed table, the best fixed choice and the figures and extras
the JSON carries.

It exists apart from the script because it reads finished runs only: the figures' definitions, in one place.
"""

from __future__ import annotations

import random
import statistics


from communication_job import AUTO_CANDIDATES, VARIANTS


def _ratio_ci(a: list[float], b: list[float]) -> tuple[float, float, float]:
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(1000))
    return statistics.median(ratios), boots[25], boots[974]


def summarize(results: list[dict], tag: str) -> dict:
    r0 = results[0]
    rows = {}
    for name in r0["times"]:
        tx = sum(r["tx"][name] for r in results)  # only local rank 0 of each host counted
        rows[name] = {
            "inter_host_bytes_per_step": tx / r0["timed"][name],
            "median_step_ms": statistics.median(r0["times"][name]) * 1e3,
            "final_loss": r0["final_loss"][name],
            "steps": r0["steps"][name],
            "round_step_s": r0["times"][name],
            "cpu_ms_per_step": r0["cpu_s_per_step"][name] * 1e3,
        }
    for name, row in rows.items():
        for base in ("flat", "hier"):
            if base in rows:
                row[f"step_vs_{base}"] = _ratio_ci(row["round_step_s"], rows[base]["round_step_s"])
                row[f"bytes_vs_{base}"] = row["inter_host_bytes_per_step"] / rows[base]["inter_host_bytes_per_step"]
    same_steps = len({row["steps"] for row in rows.values()}) == 1
    same_weights = all(
        abs(r["checksum"][n] - r0["checksum"][n]) <= 1e-6 * (1 + abs(r0["checksum"][n])) for r in results for n in rows
    )
    return {
        "tag": tag,
        "variants": rows,
        "valid": same_steps and same_weights,
        "plan": r0.get("plan"),
        "printed": r0["printed"],
    }


def print_table(summary: dict) -> None:
    print(f"\n== {summary['tag']} ==")
    header = (
        f"{'variant':<10}{'inter-host B/step':>18}{'vs flat':>9}{'ms/step':>9}{'CPU ms':>8}"
        f"{'step vs hier (95% CI)':>26}{'loss':>9}"
    )
    print(header + "\n" + "-" * len(header))
    for name, row in summary["variants"].items():
        ratio, lo, hi = row.get("step_vs_hier", (float("nan"),) * 3)
        print(
            f"{name:<10}{row['inter_host_bytes_per_step'] / 2**20:>15.2f} MB{row.get('bytes_vs_flat', 1):>9.3f}"
            f"{row['median_step_ms']:>9.0f}{row['cpu_ms_per_step']:>8.0f}{f'{ratio:.2f} ({lo:.2f}-{hi:.2f})':>26}"
            f"{row['final_loss']:>9.4f}"
        )
    if summary["plan"]:
        print("auto:", summary["printed"].get("auto"))
    if not summary["valid"]:
        print("INVALID: the variants did not take the same steps, or ranks disagree on the weights")


def best_fixed(rows: dict) -> str:
    return min(AUTO_CANDIDATES, key=lambda n: rows[n]["median_step_ms"])


def figures(shaped: dict | None, unshaped: dict | None, ssp: dict | None) -> dict:
    """The issue's figures; with --variants/--layouts, those whose variants and layouts ran."""
    s = shaped["variants"] if shaped else {}
    u = unshaped["variants"] if unshaped else {}
    wanted = {
        "hier_inter_host_bytes_vs_flat": (s, ("hier", "flat"), lambda: s["hier"]["bytes_vs_flat"]),
        "hier_step_vs_flat_100mbit": (s, ("hier", "flat"), lambda: s["hier"]["step_vs_flat"][0]),
        "int8_wire_bytes_reduction_2x4": (s, ("int8", "flat"), lambda: 1 / s["int8"]["bytes_vs_flat"]),
        "topk1_wire_bytes_reduction_2x4": (s, ("topk1", "flat"), lambda: 1 / s["topk1"]["bytes_vs_flat"]),
        "int8_step_vs_fp32_100mbit": (s, ("int8", "hier"), lambda: s["int8"]["step_vs_hier"][0]),
        "powersgd_step_vs_fp32_100mbit": (s, ("powersgd", "hier"), lambda: s["powersgd"]["step_vs_hier"][0]),
        "auto_step_vs_best_fixed_100mbit": (
            s,
            ("auto",) + AUTO_CANDIDATES,
            lambda: _ratio_ci(s["auto"]["round_step_s"], s[best_fixed(s)]["round_step_s"])[0],
        ),
        "auto_step_vs_best_fixed_unshaped": (
            u,
            ("auto",) + AUTO_CANDIDATES,
            lambda: _ratio_ci(u["auto"]["round_step_s"], u[best_fixed(u)]["round_step_s"])[0],
        ),
        "int8_final_loss_vs_fp32": (u, ("int8", "hier"), lambda: u["int8"]["final_loss"] / u["hier"]["final_loss"]),
        "powersgd_final_loss_vs_fp32": (
            u,
            ("powersgd", "hier"),
            lambda: u["powersgd"]["final_loss"] / u["hier"]["final_loss"],
        ),
    }
    out = {name: value() for name, (rows, needs, value) in wanted.items() if all(n in rows for n in needs)}
    if ssp is not None:
        out["ssp_time_to_loss_vs_sync_straggler_host"] = ssp["ratio"]
    return out


def extra_figures(summaries: dict, ssp: dict | None) -> dict:
    """Figures beyond the issue's names: the other baselines and layouts, for the README."""
    out = {}
    s = summaries.get("2x4_100mbit", {}).get("variants", {})
    if all(n in s for n in ("hier", "int8", "topk1")):
        out = {
            "int8_wire_bytes_reduction_vs_hier_2x4": s["hier"]["inter_host_bytes_per_step"]
            / s["int8"]["inter_host_bytes_per_step"],
            "topk1_wire_bytes_reduction_vs_hier_2x4": s["hier"]["inter_host_bytes_per_step"]
            / s["topk1"]["inter_host_bytes_per_step"],
            "topk1_step_vs_fp32_100mbit": s["topk1"]["step_vs_hier"][0],
        }
    t = summaries.get("2x2_100mbit", {}).get("variants", {})
    if all(n in t for n in VARIANTS[:-1]):
        out.update(
            {
                "hier_inter_host_bytes_vs_flat_2x2": t["hier"]["bytes_vs_flat"],
                "int8_wire_bytes_reduction_2x2": 1 / t["int8"]["bytes_vs_flat"],
                "topk1_wire_bytes_reduction_2x2": 1 / t["topk1"]["bytes_vs_flat"],
                "hier_step_vs_flat_100mbit_2x2": t["hier"]["step_vs_flat"][0],
                "int8_step_vs_fp32_100mbit_2x2": t["int8"]["step_vs_hier"][0],
                "powersgd_step_vs_fp32_100mbit_2x2": t["powersgd"]["step_vs_hier"][0],
            }
        )
    for schedule in ("transient", "persistent"):
        if ssp is not None and schedule in ssp:
            out[f"ssp_time_to_loss_vs_sync_{schedule}_straggler"] = ssp[schedule]
    return out
