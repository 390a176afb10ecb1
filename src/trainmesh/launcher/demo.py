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
        "(no download) with DataParallel on N local processes, in bf16 mixed precision where this "
        "machine's bf16 matmuls are fast (fp32 otherwise); write a checkpoint, logs and a loss-curve PNG to --out and print a generated "
        "sample. 1-3 minutes with 4 processes on a 2-core CPU (fp32 on a CPU without native bf16 is the slower end).",
    )
    parser.add_argument(
        "-n",
        "--nproc-per-node",
        type=run.positive_int,
        default=None,
        metavar="N",
        help="worker processes (default: one per GPU where there are GPUs, else 4)",
    )
    parser.add_argument(
        "--out", default="trainmesh-demo", metavar="DIR", help="output directory (default: ./trainmesh-demo)"
    )
    parser.add_argument(
        "--epochs", type=run.positive_int, default=None, metavar="E", help="training epochs (default: 2)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny corpus and model that finish in seconds (for tests and smoke checks)",
    )
    parser.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16-mixed"),
        default="auto",
        help="compute precision (default auto: bf16-mixed on a CPU with AMX, fp32 on one with AVX2 "
        "only; elsewhere bf16-mixed where bf16 matmuls run >= 1.5x fp32's speed, as with "
        "AVX512-BF16, fp32 otherwise)",
    )
    return parser


def job_argv(args: argparse.Namespace) -> list[str]:
    """The arguments of :mod:`trainmesh.demo.job`."""
    argv = ["--out", str(Path(args.out))]
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    if args.quick:
        argv.append("--quick")
    if args.precision != "auto":
        argv += ["--precision", args.precision]
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
    args = _resolve_nproc(_resolve_precision(args))
    _ensure_peak_probe(args.precision)
    status = run.handle(*run_args(args))
    if status == 0:
        print(f"[demo] finished in {time.perf_counter() - started:.0f}s (launch included)", flush=True)
    return status


def _resolve_precision(args: argparse.Namespace) -> argparse.Namespace:
    """``--precision auto`` becomes one concrete choice, made here once: workers that each timed
    bf16 against fp32 on a busy machine could disagree."""
    if args.precision != "auto":
        return args
    import torch

    from trainmesh.trainer.precision import fastest_precision

    precision, why = fastest_precision("cuda" if torch.cuda.is_available() else "cpu")
    print(f"[demo] precision {precision}: {why}", flush=True)
    return argparse.Namespace(**{**vars(args), "precision": precision})


def _resolve_nproc(args: argparse.Namespace) -> argparse.Namespace:
    """One process per GPU (NCCL drives one each), as ``torchrun --nproc-per-node gpu`` does; four
    CPU processes otherwise."""
    if args.nproc_per_node is not None:
        return args
    import torch

    return argparse.Namespace(**{**vars(args), "nproc_per_node": torch.cuda.device_count() or 4})


def _ensure_peak_probe(precision: str) -> None:
    """The demo shows MFU: without a cached peak for this CPU in the demo's compute dtype
    (``trainmesh env --peak``), probe it once now, before any worker starts (about 2 s, cached for
    later runs and jobs). On a GPU machine the workers' device is not this process's business:
    they show MFU if a peak is cached."""
    import torch

    from trainmesh.trainer.precision import compute_dtype, dtype_short_name
    from trainmesh.trainer.throughput import cached_peak_flops, measure_peak_flops

    dtype = compute_dtype(precision)
    if torch.cuda.is_available() or cached_peak_flops(dtype, "cpu") is not None:
        return
    peak = measure_peak_flops(dtype, seconds=2.0)
    name = dtype_short_name(dtype)
    print(
        f"[demo] {name} matmul peak of this node: {peak / 1e9:.0f} GFLOP/s (trainmesh env --peak {name}; "
        "cached for MFU)",
        flush=True,
    )
