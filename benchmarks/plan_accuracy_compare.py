"""plan_accuracy.py's comparison of one world size's cases: each round's plan, priced with that round's
probes, against its measured step, socket bytes and memory peak; the same-work check (FLOPs); the rows,
worst ratios and INVALID lines the script prints and writes.

It exists apart from the script because it holds the figures' per-case definitions in one place.
"""

from __future__ import annotations

import statistics


from trainmesh.testing.stats import ci95

from plan_accuracy_plan import _median_hardware, _price, _round_hardware
from plan_accuracy_setup import _is_pipe


def _compare(
    group: list,
    dry: list,
    measured: list[dict],
    hardware,
    rounds: int,
    link: str,
    rows: list,
    worst: dict,
    invalid: list,
) -> None:
    """Price each case of ``group`` (one world size, measured on ``link``) with ``hardware`` and the figures measured
    during its rounds, against what its processes measured; rows, worst ratios and INVALID lines are appended."""
    n = group[0][0]
    during = _median_hardware(hardware, measured[0]["probes"])
    print(
        f"\n{n} processes, {link}; per-op figures measured during the rounds (median of {rounds}):\n"
        + "\n".join(during.describe().splitlines()[1:4])
        + f"\n  external load {during.external_load:.1f} runnable"
    )
    for index, (case, results) in enumerate(zip(group, dry)):
        plan = _price(case, results, during)
        before = _price(case, results, hardware).get("step").seconds
        round_hw = [_round_hardware(hardware, measured, k, index) for k in range(rounds)]
        planned = [_price(case, results, hw)["step"] for hw in round_hw]
        plan["step"] = sorted(planned, key=lambda e: e.seconds)[len(planned) // 2]  # the median round's plan
        slowdowns = [hw.contention(n) for hw in round_hw]
        per_round = [max(measured[r]["times"][index][k] for r in range(n)) for k in range(rounds)]
        median, (low, high) = statistics.median(per_round), ci95(per_round)
        cpu_used = statistics.median(statistics.median(measured[r]["cpu"][index]) for r in range(n))
        # Each round's step against the plan priced with that round's figures (measured beside it):
        # the load moves both together, so the per-round ratio is the plan's error, not the load's.
        paired = [e.seconds / t for e, t in zip(planned, per_round)]
        step_ratio = statistics.median(paired)
        unpaired = plan["step"].seconds / median
        print(
            f"  {case[4]:<10} each of {n} processes {statistics.median(slowdowns):.2f}x slower than one alone "
            f"(rounds {min(slowdowns):.2f}-{max(slowdowns):.2f}); plan/step per round {step_ratio:.2f} "
            f"(95% {ci95(paired)[0]:.2f}-{ci95(paired)[1]:.2f}); median plan / median step {unpaired:.2f}"
        )
        worst["step"].append(step_ratio)
        for rank in range(n):
            real = measured[rank]
            tolerance = 0.02 if _is_pipe(case[1]) else 0.0
            if abs(plan["flops"][rank] - real["flops"][index]) > tolerance * real["flops"][index]:
                invalid.append(
                    f"{case[4]} n={n} ({link}) rank {rank}: planned {plan['flops'][rank]} and run "
                    f"{real['flops'][index]} FLOPs differ (not the same work)"
                )
            socket = statistics.median(real["wire"][index])
            comm = plan["wire"][rank] / socket if socket > 0 else (1.0 if plan["wire"][rank] == 0 else float("nan"))
            memory = plan["peaks"][rank] / real["peaks"][index]
            worst["memory"].append(memory)
            worst["comm"].append(comm)
            rows.append(
                {
                    "case": case[4],
                    "n": n,
                    "mesh": case[1],
                    "link": link,
                    "rank": rank,
                    "plan_peak": plan["peaks"][rank],
                    "peak": real["peaks"][index],
                    "memory_ratio": memory,
                    "plan_wire": plan["wire"][rank],
                    "socket_bytes": socket,
                    "comm_ratio": comm,
                    "plan_ops": plan["ops"][rank],
                    "ops": real["ops"][index],
                    "plan_step": plan["step"].seconds,
                    "step": median,
                    "step_ci95": [low, high],
                    "step_cpu": cpu_used,
                    "step_ratio": step_ratio,
                    "step_ratio_unpaired": unpaired,
                    "step_ratio_rounds": paired,
                    "step_slowdown_rounds": slowdowns,
                    "plan_step_before": before,
                    "step_ratio_before": before / median,
                    "step_ratio_ci95": list(ci95(paired)),
                    "plan_parts": {
                        **{k: v for k, v in plan["step"].phases.items()},
                        **{f"{a} exposed": v for a, v in plan["step"].exposed.items()},
                    },
                }
            )
