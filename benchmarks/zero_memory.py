"""Per-rank memory and step time of trainmesh ZeRO stages 0-3 against DeepSpeed ZeRO 1/2/3.

    pip install -e '.[bench]'      # includes deepspeed; see benchmarks/README.md for keeping torch
    python benchmarks/zero_memory.py [--nproc N] [--rounds R] [--steps S] [--mem-steps M]
                                     [--warmup W] [--systems trainmesh,deepspeed] [--stages 0,1,2,3]
                                     [--precision auto|fp32|bf16-mixed] [--json PATH] [--quick]

Every variant (a system at a stage) trains the same ~50M-parameter GPT-style transformer
(8 blocks, d_model 640, vocab 8192, seq 128) from the same seed on the same token batches, on N
(default 4) gloo CPU processes started with ``python -m torch.distributed.run --standalone``, in one
precision on both sides (``--precision``; ``auto``, the default, takes what
``trainmesh.trainer.precision.fastest_precision("cpu")`` picks, as the demo does: bf16-mixed where
bf16 matmuls pay, fp32 where they do not, e.g. on an AVX2-only CPU where they run ~0.02x fp32's speed):

* bf16-mixed: bf16 compute with fp32 master weights and fp32 Adam state on both sides, gradients
  reduced in bf16 on both sides at stages 1-3 (DeepSpeed's default communication dtype under bf16;
  trainmesh's reduce_dtype). trainmesh ``precision="bf16-mixed"``; DeepSpeed ``"bf16": {"enabled":
  True}`` (bf16 parameters and gradients, fp32 master partitions inside its ZeRO optimizer: the ZeRO
  paper's mixed precision).
* fp32: everything in fp32 on both sides, gradients reduced in fp32 (both sides' default).
  trainmesh ``precision="fp32"``; DeepSpeed without a ``bf16``/``fp16`` block (its fp32 path).

* trainmesh: ``tm.Trainer(model, Adam, loss, zero_stage=k, precision=..., progress=False)``
  (stage 0: DDP; 1-3: FSDP2 ``fully_shard``; stage 1 differs from 2 only under accumulation).
* DeepSpeed: ``deepspeed.initialize(model=..., optimizer=Adam, config={...precision block...,
  "zero_optimization": {"stage": k, ...}})`` with ``DS_ACCELERATOR=cpu``.

Each variant runs in its own fresh set of processes (peak memory needs a clean process), and the
variants are interleaved stage by stage (trainmesh-k, deepspeed-k, then the other order next round).
Per variant: M instrumented steps (memory), W untimed warmup steps, S timed steps.

Memory, per rank:

* ``peak live``: the most tensor bytes alive at once during the M instrumented steps
  (``trainmesh.testing.memory.LiveTensorBytes``). A ``TorchDispatchMode`` entered before the model is built sees every tensor an operator creates
  (also from C++, e.g. DDP's buckets), counts each storage once on creation and releases it with a
  weakref callback when it dies; ``UntypedStorage.resize_`` (FSDP2 frees and re-allocates gathered
  parameters that way) is followed too. Not seen: scratch memory inside a kernel or a gloo thread.
* ``RSS delta``: ``VmHWM`` (high-water RSS, reset after setup through /proc/self/clear_refs) minus
  ``VmRSS`` after setup: what the OS saw the steps add. The allocator may reuse memory freed in setup
  without raising RSS, so this under-counts; it is a cross-check, the targets use ``peak live``.
* ``model state``: params + grads + optimizer state held by the rank, counted from the tensors
  themselves (local shards; each storage once, padding included) at the end of the optimizer
  update of the last instrumented step, when gradients and optimizer state both exist. Extra
  gradient storage a system keeps is counted as gradients (DDP's flat buckets, unreachable from
  Python, are added as their size when ``gradient_as_bucket_view`` is off; DeepSpeed's reduce
  buckets and gradient partitions are found by walking its ZeRO optimizer object).

Targets (issue 4): trainmesh model state within 10% of the ZeRO formula for what it stores;
peak memory (``peak live``) <= DeepSpeed's at every stage; step time <= DeepSpeed's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the parts beside it, when loaded by path
from zero_memory_report import formulas, matching_formula, print_report, summarize  # noqa: E402
from zero_memory_setup import FULL_MODEL, PRECISIONS, QUICK_MODEL, choose_precision, deepspeed_config  # noqa: E402
from zero_memory_worker import worker  # noqa: E402

__all__ = ["PRECISIONS", "choose_precision", "deepspeed_config", "formulas", "main", "matching_formula"]

# --------------------------------------------------------------------------- the driver
RETRIES: list[dict] = []  # failed attempts of this run, in the JSON as "retries"


def run_variant(variant: str, cfg: dict, tmp: str, timeout: float) -> list[dict]:
    out = os.path.join(tmp, f"{variant}.json")
    cfg_path = os.path.join(tmp, "cfg.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TRAINMESH_TIMEOUT_S="600")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(cfg["nproc"]),
        os.path.abspath(__file__),
        "--worker",
        variant,
        "--cfg",
        cfg_path,
        "--out",
        out,
    ]
    started = time.time()
    for attempt in (1, 2):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 and os.path.exists(out):
            break
        tail = (proc.stdout[-2000:] + proc.stderr[-4000:]).strip().splitlines()
        # Seen on the loaded shared machine: a rank aborting ("terminate called without an active
        # exception") in a run that otherwise completes. One fresh retry, said loudly and recorded.
        print(
            f"  {variant}: attempt {attempt} failed (exit {proc.returncode}): "
            f"{next((l for l in tail if 'terminate' in l or 'Error' in l), tail[-1] if tail else '')}",
            flush=True,
        )
        RETRIES.append({"variant": variant, "attempt": attempt, "exit": proc.returncode})
        if attempt == 2:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise RuntimeError(f"variant {variant} failed (exit {proc.returncode})")
    print(f"  {variant}: {time.time() - started:.1f} s", flush=True)
    with open(out) as fh:
        return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="processes (world size), default 4")
    parser.add_argument("--rounds", type=int, default=1, help="times each variant is run (fresh processes), default 1")
    parser.add_argument("--steps", type=int, help="timed steps per variant (default 3; --quick 5)")
    parser.add_argument("--mem-steps", type=int, default=2, help="instrumented steps for memory (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps between memory and timed steps")
    parser.add_argument("--batch", type=int, help="global batch in sequences (default 2 per process)")
    parser.add_argument("--systems", default="trainmesh,deepspeed")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--precision",
        choices=("auto", *PRECISIONS),
        default="auto",
        help="both sides' precision; auto (default): bf16-mixed where bf16 matmuls pay here, else fp32",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full results as JSON here")
    parser.add_argument("--quick", action="store_true", help="a small model, about a minute")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        with open(args.cfg) as fh:
            worker(json.load(fh), args.worker, args.out)
        return 0

    cfg = {
        "nproc": args.nproc,
        "rounds": args.rounds,
        "steps": args.steps or (5 if args.quick else 3),
        "mem_steps": args.mem_steps,
        "warmup": args.warmup,
        "batch": args.batch or 2 * args.nproc,
        "seed": args.seed,
        "quick": args.quick,
        "model": QUICK_MODEL if args.quick else FULL_MODEL,
    }
    cfg["precision"], cfg["precision_why"] = choose_precision(args.precision)
    print(f"precision: {cfg['precision']} ({cfg['precision_why']})", flush=True)
    if cfg["batch"] % cfg["nproc"] or min(cfg["steps"], cfg["mem_steps"], cfg["rounds"]) < 1:
        parser.error("--batch must be a multiple of --nproc; --steps, --mem-steps, --rounds >= 1")
    systems = [s for s in args.systems.split(",") if s]
    stages = [int(s) for s in args.stages.split(",") if s]
    if "deepspeed" in systems:
        try:
            import deepspeed  # noqa: F401
        except ImportError as error:
            print(
                f"deepspeed is not importable ({error}); install it (see benchmarks/README.md) or pass "
                "--systems trainmesh",
                file=sys.stderr,
            )
            return 2
    # Stage by stage, the two systems back to back, the order alternating: drift hits both alike.
    schedule = []
    for r in range(cfg["rounds"]):
        for i, stage in enumerate(stages):
            pair = [f"{s}-{stage}" for s in systems if not (s == "deepspeed" and stage == 0)]
            schedule.extend(pair if (r + i) % 2 == 0 else pair[::-1])
    load_before = os.getloadavg()[0]
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="zero-memory-") as tmp:
        for variant in schedule:
            runs.setdefault(variant, []).append(run_variant(variant, cfg, tmp, timeout=900))
    report = summarize(runs, cfg)
    report["schedule"] = schedule
    report["retries"] = RETRIES
    report["raw_per_rank"] = runs  # every rank's own numbers, DeepSpeed's config and version included
    report["load_avg_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.json}")
    return 0 if report["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
