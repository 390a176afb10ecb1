"""The scaling table of ``docs/planner.md``: Llama-7B and 70B at 8 to 1,024 ranks, as planned.

Each row is one ``plan_parallel`` run (the same dry run and pricing as ``trainmesh plan``) on the
published H100 figures (``hardware.HARDWARE["h100"]``); the output is a markdown table labelled as
a plan, with how long each row took to plan. Nothing here is measured on GPUs.

    python -m trainmesh.planner.scaling_table [--rows 7b] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .report import format_bytes

# (model, ranks, mesh): the data axis alone while a rank's shards fit; a model axis of one node's 8
# where they would not (70B) or where the data axis alone leaves too few tokens per collective (1,024)
ROWS = (
    ("llama-7b", 8, "data=8"),
    ("llama-7b", 64, "data=64"),
    ("llama-7b", 256, "data=256"),
    ("llama-7b", 1024, "data=128,model=8"),
    ("llama-70b", 8, "data=1,model=8"),
    ("llama-70b", 64, "data=8,model=8"),
    ("llama-70b", 256, "data=32,model=8"),
    ("llama-70b", 1024, "data=128,model=8"),
)
SETTINGS = dict(
    zero_stage=3,
    activation_checkpointing="full",
    micro_batch=2,
    seq_len=4096,
    device_memory="80GB",
    hardware="h100",
    precision="bf16-mixed",
)
HEADER = (
    "| model | ranks | mesh | per-rank peak | fits 80 GB | communication share | scaling efficiency "
    "| MFU (peak kernels) | step |\n| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: |"
)


def plan_row(model: str, ranks: int, mesh: str) -> dict:
    from .parallel import plan_parallel

    start = time.perf_counter()
    plan = plan_parallel(model, world_size=ranks, mesh=mesh, **SETTINGS)
    s = plan.step
    return {
        "model": model,
        "ranks": ranks,
        "mesh": mesh,
        "peak_bytes": plan.peak_bytes,
        "fits": plan.fits,
        "comm_share": s.comm_share,
        "scaling_efficiency": s.scaling_efficiency,
        "mfu": s.mfu,
        "step_s": s.seconds,
        "phases_s": s.phases,
        "exposed_s": s.exposed,
        "plan_seconds": time.perf_counter() - start,
    }


def markdown(rows: list[dict]) -> str:
    lines = [HEADER]
    for r in rows:
        mfu = f"{r['mfu']:.0%}" if r["mfu"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['ranks']:,} | `{r['mesh']}` | {format_bytes(r['peak_bytes'])} | "
            f"{'yes' if r['fits'] else 'no'} | {r['comm_share']:.0%} | {r['scaling_efficiency']:.0%} | "
            f"{mfu} | {r['step_s'] * 1e3:.0f} ms |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=None, help="only rows whose model contains this (e.g. 7b)")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    rows = []
    for model, ranks, mesh in ROWS:
        if args.rows and args.rows not in model:
            continue
        rows.append(plan_row(model, ranks, mesh))
        print(f"planned {model} at {ranks} ranks ({mesh}) in {rows[-1]['plan_seconds']:.0f} s", file=sys.stderr)
    print("A PLAN, not a measurement (published H100 figures; trainmesh plan's dry run and pricing)")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": SETTINGS, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
