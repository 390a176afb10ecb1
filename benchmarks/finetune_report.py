"""finetune.py's report: the summary of finished runs (memory: the worst process of each launch, the median
over launches; step times and their per-round ratios; the same-work check; the figures and their validity),
the goals they are judged against, the settings each side ran with, and the printed table.

It exists apart from the script because it reads finished runs only: the figures' definitions, in one place.
"""

from __future__ import annotations

import statistics

from finetune_parity import PARITY_STEPS
from finetune_sides import LORA, TARGET_MODULES, WORLD

LOSS_TOLERANCE = {"fp32": 1e-5, "bf16-mixed": 2e-2}
GOALS = {  # figure -> (text, test)
    "lora_grad_bytes_vs_full": ("<= 0.05", lambda v: v <= 0.05),
    "lora_peak_vs_full_ft": ("<= 0.5", lambda v: v <= 0.5),
    "lora_step_vs_full_ft": ("<= 0.7", lambda v: v <= 0.7),
    # issue 47: ZeRO-3 LoRA within 1.15x peft under DDP (it shards the base), DataParallel LoRA at most 1.0x
    "lora_step_vs_peft_ddp": ("<= 1.15", lambda v: v <= 1.15),
    "lora_dp_step_vs_peft_ddp": ("<= 1.0", lambda v: v <= 1.0),
    "lora_parity_max_abs_diff": ("<= 1e-5", lambda v: v <= 1e-5),
}
PEER_SETTINGS = {
    "peft": "get_peft_model(from_pretrained(DIR), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="
    "q,k,v,o,gate,up,down, task_type=CAUSAL_LM)), peft's default init (lora_B zero)",
    "DDP": "DistributedDataParallel(model, gradient_as_bucket_view=True); torch's defaults otherwise "
    "(bucket_cap_mb 25, find_unused_parameters False, broadcast_buffers True); frozen parameters are in no "
    "bucket",
    "optimizer": "torch.optim.AdamW(trainable parameters, lr=1e-4, weight_decay=0), torch's default kernels, "
    "zero_grad(set_to_none=True)",
    "accelerate": "Accelerator(cpu=True, mixed_precision as the run, kwargs_handlers=[DistributedDataParallelKwargs("
    "gradient_as_bucket_view=True)]); accelerator.backward",
}
TRAINMESH_SETTINGS = (
    "tm.Trainer(meta-built model, AdamW factory, loss, zero_stage=3, weights=DIR, precision=<run's>, "
    "progress=False); every other option its default (log_every_n_steps=1, nonfinite_loss='skip')"
)


def _median(values):
    return statistics.median(values) if values else float("nan")


def summarize(cfg: dict, memory: dict, timing: list[dict], parity: dict, counts: dict) -> dict:
    from trainmesh.testing.stats import median_ci95

    report = {"config": {k: v for k, v in cfg.items() if k != "base_dir"}, "counts": counts}
    # memory: the worst process of each launch, the median over launches
    mem = {}
    for side, launches in memory.items():
        worst = lambda key: _median([max(r[key] for r in ranks) for ranks in launches])  # noqa: E731
        mem[side] = {
            "rss_growth": worst("rss_growth"),
            "rss_growth_build": worst("rss_growth_build"),
            "live_peak": worst("live_peak"),
            "live_peak_build": worst("live_peak_build"),
            "live_peak_steps": worst("live_peak_steps"),
            "live_after_build": worst("live_after_build"),
            "vmhwm": worst("vmhwm"),
            "malloc_free": worst("malloc_free") if launches[0][0]["malloc_free"] is not None else None,
            "rss_file_growth": worst("rss_file_growth"),
            "peak_census_rank0": launches[0][0]["peak_census"],
            "grad_bytes": _median([ranks[0]["grad_bytes"] for ranks in launches]),
            "gather_bytes": _median([ranks[0]["gather_bytes"] for ranks in launches]),
            "collectives_rank0": launches[0][0]["collectives"],
        }
    report["memory"] = mem
    # step times: a step is as slow as its slowest process
    sides = cfg["sides"]
    steps = {
        s: [[max(ts) for ts in zip(*(res["times"][s][r] for res in timing))] for r in range(cfg["rounds"])]
        for s in sides
    }
    med = {s: _median([t for rnd in steps[s] for t in rnd]) for s in sides}
    report["step_s"] = {
        s: {
            "median": med[s],
            "per_round_median": [_median(rnd) for rnd in steps[s]],
            "ci95_of_median": median_ci95([t for rnd in steps[s] for t in rnd]),
        }
        for s in sides
    }
    report["orders"] = timing[0]["orders"]

    def ratio(a: str, b: str) -> dict | None:
        if a not in sides or b not in sides:
            return None
        rounds = [_median(x) / _median(y) for x, y in zip(steps[a], steps[b])]
        return {
            "ratio": _median(rounds),
            "per_round": rounds,
            "pooled": med[a] / med[b],
            "ci95": median_ci95(rounds) if len(rounds) > 1 else None,
        }

    report["step_ratios"] = {
        name: ratio(a, b)
        for name, (a, b) in {
            "lora_step_vs_full_ft": ("tm-lora", "tm-full"),
            "lora_step_vs_peft_ddp": ("tm-lora", "peft-ddp"),
            "lora_step_vs_accelerate": ("tm-lora", "accelerate"),
            "lora_dp_step_vs_peft_ddp": ("tm-lora-dp", "peft-ddp"),
            "lora_regather_step_vs_peft_ddp": ("tm-lora-regather", "peft-ddp"),
            "lora_step_vs_regather": ("tm-lora", "tm-lora-regather"),
            "accelerate_step_vs_peft_ddp": ("accelerate", "peft-ddp"),
        }.items()
        if ratio(a, b) is not None
    }
    # same work: every side's first global loss (the same base model, the same rows, lora_B = 0)
    first = {s: timing[0]["losses"][s][0][0] for s in sides}
    reference = first["tm-full"] if "tm-full" in first else next(iter(first.values()))
    tolerance = LOSS_TOLERANCE[cfg["precision"]]
    report["first_losses"] = first
    report["same_work"] = all(abs(v - reference) <= tolerance * abs(reference) for v in first.values())
    report["final_losses"] = {s: timing[0]["losses"][s][-1][-1] for s in sides}
    report["parity"] = parity
    figures = {}
    if "tm-lora" in mem and "tm-full" in mem:
        figures["lora_grad_bytes_vs_full"] = mem["tm-lora"]["grad_bytes"] / mem["tm-full"]["grad_bytes"]
        figures["lora_peak_vs_full_ft"] = mem["tm-lora"]["rss_growth"] / mem["tm-full"]["rss_growth"]
    for name in ("lora_step_vs_full_ft", "lora_step_vs_peft_ddp"):
        if name in report["step_ratios"]:
            figures[name] = report["step_ratios"][name]["ratio"]
    figures["lora_parity_max_abs_diff"] = max(parity["max_abs_diff"].values())
    figures["lora_parity_adamw_max_abs_diff"] = max(parity["adamw_max_abs_diff"].values())
    figures["adamw_microbatch_noise_1proc"] = parity["adamw_microbatch_noise_1proc"]
    if "tm-lora" in mem and "tm-full" in mem:
        figures["lora_peak_live_vs_full_ft"] = mem["tm-lora"]["live_peak"] / mem["tm-full"]["live_peak"]
        figures["lora_steps_peak_live_vs_full_ft"] = (
            mem["tm-lora"]["live_peak_steps"] / mem["tm-full"]["live_peak_steps"]
        )
        figures["lora_gather_bytes_vs_full"] = mem["tm-lora"]["gather_bytes"] / mem["tm-full"]["gather_bytes"]
    if "tm-lora" in mem and "peft-ddp" in mem:
        figures["lora_peak_vs_peft_ddp"] = mem["tm-lora"]["rss_growth"] / mem["peft-ddp"]["rss_growth"]
    if "tm-lora-notrim" in mem and "tm-full-notrim" in mem:
        figures["lora_peak_vs_full_ft_without_trim"] = (
            mem["tm-lora-notrim"]["rss_growth"] / mem["tm-full-notrim"]["rss_growth"]
        )
    if "tm-lora-upcast" in mem and "tm-full-upcast" in mem:
        figures["lora_peak_vs_full_ft_upcast_loss"] = (
            mem["tm-lora-upcast"]["rss_growth"] / mem["tm-full-upcast"]["rss_growth"]
        )
        figures["lora_peak_live_vs_full_ft_upcast_loss"] = (
            mem["tm-lora-upcast"]["live_peak"] / mem["tm-full-upcast"]["live_peak"]
        )
    if "tm-lora-regather" in mem and "tm-full" in mem:
        figures["lora_regather_peak_vs_full_ft"] = mem["tm-lora-regather"]["rss_growth"] / mem["tm-full"]["rss_growth"]
    for name in (
        "lora_step_vs_accelerate",
        "lora_dp_step_vs_peft_ddp",
        "lora_regather_step_vs_peft_ddp",
        "lora_step_vs_regather",
    ):
        if name in report["step_ratios"]:
            figures[name] = report["step_ratios"][name]["ratio"]
    report["figures"] = figures
    report["valid"] = report["same_work"] and parity["adapters_moved"] > 1e-3 and parity["frozen_unchanged"]
    return report


def print_report(report: dict) -> None:
    cfg, mb = report["config"], 2**20
    size, counts = cfg["size"], report["counts"]
    print(
        f"Llama {counts['params'] / 1e6:.1f}M parameters (hidden {size['hidden']}, {size['layers']} layers, "
        f"vocabulary {size['vocab']}), LoRA r={LORA['r']} on {','.join(TARGET_MODULES)}: "
        f"{counts['trainable'] / 1e6:.2f}M trainable ({counts['trainable'] / counts['params']:.1%}); "
        f"{WORLD} gloo processes x 1 thread; "
        f"{size['rows']} x {size['seq']} tokens per process and step; precision {cfg['precision']} "
        f"({cfg['precision_why']}); {cfg['rounds']} rounds x ({cfg['warmup']} warmup + {cfg['steps']} timed steps) "
        f"per side; memory: {cfg['mem_rounds']} fresh launch(es) per side x {cfg['mem_steps']} steps"
    )
    print(f"trainmesh: {TRAINMESH_SETTINGS}")
    for name, text in PEER_SETTINGS.items():
        print(f"peer {name}: {text}")
    if cfg.get("skipped"):
        print("not run: " + "; ".join(cfg["skipped"]))
    cols = ("RSS+ build", "RSS+ peak", "live build", "live steps", "malloc free", "grad/step", "gather/step")
    header = f"{'side':<12}{'step s':>8}{'95% CI':>11}" + "".join(f"{c:>12}" for c in cols) + f"{'1st loss':>10}"
    print(header + "\n" + "-" * len(header))
    for side in cfg["sides"]:
        st, m = report["step_s"][side], report["memory"].get(side)
        lo, hi = st["ci95_of_median"]
        keys = (
            "rss_growth_build",
            "rss_growth",
            "live_peak_build",
            "live_peak_steps",
            "malloc_free",
            "grad_bytes",
            "gather_bytes",
        )
        mem_cols = "".join(f"{(m[k] or 0) / mb:>12.1f}" if m else f"{'-':>12}" for k in keys)
        interval = f"{lo:.2f}-{hi:.2f}"
        print(f"{side:<12}{st['median']:>8.3f}{interval:>11}{mem_cols}{report['first_losses'][side]:>10.5f}")
    print(
        "MB (2^20 bytes), the worst process: RSS+ = peak RSS growth from before the model is built, to the end of "
        "building / of the memory steps; live = most tensor bytes alive at once while building / during the steps; "
        "malloc free = what glibc malloc holds free at the end"
    )
    print(
        "grad / gather MB: one process's gradient collectives (ZeRO-3 reduce-scatters, DDP all-reduces) and "
        "parameter all-gathers per step, full buffers, counted at the dispatcher"
    )
    for side, m in report["memory"].items():
        census = m["peak_census_rank0"]
        largest = ", ".join(f"{mib:g}x{n}" for mib, n in census["largest_mib_x_count"])
        print(
            f"{side} step peak (rank 0, first launch) at {census['op']}: largest storages MiB x count {largest}; "
            f"the rest {census['rest_bytes'] / mb:.1f} MiB; file-backed RSS growth (library code) "
            f"{m['rss_file_growth'] / mb:.1f} MiB; made by: "
            + ", ".join(f"{mib:g} {by}" for mib, by in census.get("made_by", [])[:10])
        )
    p = report["parity"]
    print(
        f"parity ({PARITY_STEPS} steps of SGD lr 0.5 momentum 0.9, fp32, adapters vs one process): "
        + ", ".join(f"{k} {v:.3g}" for k, v in p["max_abs_diff"].items())
        + "; with AdamW (lr 1e-2): "
        + ", ".join(f"{k} {v:.3g}" for k, v in p["adamw_max_abs_diff"].items())
        + f" against AdamW's own noise on one process (4 micro-batches vs 1) {p['adamw_microbatch_noise_1proc']:.3g}"
        + f"; adapters moved {p['adapters_moved']:.3g}; frozen base unchanged: {p['frozen_unchanged']}; "
        f"TP sharded parameters {p['tp_sharded_params']}"
    )
    print()
    quick = " (--quick: smoke run, too few steps to judge)" if cfg["quick"] else ""
    print(f"{'figure':<30}{'value':>10}  {'goal':<9}{'verdict':<9}per-round range")
    for name, value in report["figures"].items():
        goal = GOALS.get(name)
        verdict = ("met" if goal[1](value) else "NOT MET") if goal else "-"
        rounds = report["step_ratios"].get(name, {}).get("per_round")
        spread = f"{min(rounds):.3f}-{max(rounds):.3f}" if rounds else ""
        print(f"{name:<30}{value:>10.4g}  {goal[0] if goal else '-':<9}{verdict:<9}{spread}")
    if quick:
        print(quick.strip())
    if not report["same_work"]:
        print(
            f"INVALID: first-step losses differ beyond {LOSS_TOLERANCE[cfg['precision']]:g} relative: "
            f"{report['first_losses']}"
        )
    elif not report["valid"]:
        print("INVALID: the parity run did not train the adapters or changed the frozen base")
