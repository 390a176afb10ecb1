"""``trainmesh demo``: train a small character-level GPT on N local processes, end to end.

The demo is an ordinary trainmesh job (:mod:`trainmesh.demo.job`) launched exactly as a user
would launch their own: this command builds a ``trainmesh run -n N -m trainmesh.demo.job ...``
command line and hands it to :mod:`trainmesh.launcher.run` (torchrun underneath), so the demo
exercises the launcher, the rendezvous, DataParallel and the Trainer together.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import run

JOB_MODULE = "trainmesh.demo.job"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``trainmesh demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="train a small character-level GPT on the Python stdlib (N local processes)",
        description="Train a small GPT-style character model on this Python's own standard-library sources "
        "(no download) with DataParallel on N local processes, bf16 mixed precision and gradient "
        "accumulation; write a checkpoint, logs and a loss-curve PNG to --out and print a generated "
        "sample. About 2 minutes with 4 processes on a 2-core CPU.",
    )
    parser.add_argument("-n", "--nproc-per-node", type=run.positive_int, default=4, metavar="N",
                        help="worker processes (default: 4)")
    parser.add_argument("--out", default="trainmesh-demo", metavar="DIR",
                        help="output directory (default: ./trainmesh-demo)")
    parser.add_argument("--epochs", type=run.positive_int, default=None, metavar="E",
                        help="training epochs (default: 2)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny corpus and model that finish in seconds (for tests and smoke checks)")
    return parser


def job_argv(args: argparse.Namespace) -> list[str]:
    """The arguments of :mod:`trainmesh.demo.job`."""
    argv = ["--out", str(Path(args.out))]
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    if args.quick:
        argv.append("--quick")
    return argv


def run_args(args: argparse.Namespace) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """The parsed ``trainmesh run`` equivalent of ``args``, and its parser.

    Parsed by ``run``'s own parser (not assembled by hand), so every ``run`` default and any
    option ``run`` gains later apply here unchanged.
    """
    holder = argparse.ArgumentParser(prog="trainmesh")
    run_parser = run.add_parser(holder.add_subparsers())
    argv = ["-n", str(args.nproc_per_node), "-m", JOB_MODULE, *job_argv(args)]
    return run_parser.parse_args(argv), run_parser


def handle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Launch the job; return its exit status (0, or the first failed worker's)."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out must be a directory. Received: {str(out)!r} is a file")
    started = time.perf_counter()
    _ensure_peak_probe()
    status = run.handle(*run_args(args))
    if status == 0:
        print(f"[demo] finished in {time.perf_counter() - started:.0f}s (launch included)", flush=True)
    return status


def _ensure_peak_probe() -> None:
    """The demo shows MFU: without a cached bf16 peak for this CPU (``trainmesh env --peak``), probe
    it once now, before any worker starts (2 s, cached for later runs and jobs). On a GPU machine
    the workers' device is not this process's business: they show MFU if a peak is cached."""
    import torch

    from trainmesh.trainer.throughput import cached_peak_flops, measure_peak_flops

    if torch.cuda.is_available() or cached_peak_flops(torch.bfloat16, "cpu") is not None:
        return
    peak = measure_peak_flops(torch.bfloat16, seconds=2.0)
    print(f"[demo] bf16 matmul peak of this node: {peak / 1e9:.0f} GFLOP/s (trainmesh env --peak; cached for MFU)",
          flush=True)
