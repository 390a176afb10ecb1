"""``trainmesh env``: what a trainmesh process started here would see, without joining any job.

Everything is read from the environment and from torch's local queries: no socket is opened
and no process group is started, so the command is safe to run on a login node or inside a
worker's environment to debug rank detection.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

import trainmesh
from trainmesh.runtime import detect_cluster_env, list_devices
from trainmesh.runtime.addresses import parse_server_list


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``trainmesh env``."""
    parser = subparsers.add_parser(
        "env",
        help="show the detected cluster environment, backend and devices",
        description="Show the cluster environment this process would join (from torchrun, "
        "TRAINMESH_*, TF_CONFIG or Slurm variables), the backend and devices, and versions. "
        "Opens no connection.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--peak",
        nargs="?",
        const="bf16",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="measure this machine's matmul FLOP/s ceiling in the given dtype (default bf16; "
        "on CPU with every core, the node's), cache it for the Trainer's MFU, and print it",
    )
    parser.add_argument("--peak-seconds", type=float, default=3.0, help="how long the --peak probe runs")
    return parser


def _measure_peak(dtype_name: str, seconds: float) -> dict[str, Any]:
    from trainmesh.trainer.precision import DTYPES_BY_SHORT_NAME
    from trainmesh.trainer.throughput import _cache_file, measure_peak_flops

    if not seconds > 0:
        raise ValueError(f"--peak-seconds must be > 0. Received: {seconds}")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    flops = measure_peak_flops(DTYPES_BY_SHORT_NAME[dtype_name], device_type=device_type, seconds=seconds)
    return {"peak_dtype": dtype_name, "peak_flops": flops, "peak_device": device_type, "peak_cache": str(_cache_file())}


def collect() -> dict[str, Any]:
    """The report as a flat dict; raises ValueError when the environment contradicts itself (a bad
    address included: a port outside 1..65535, an empty host, an address used twice)."""
    cluster = detect_cluster_env()
    ps_raw = os.environ.get("TRAINMESH_PS_SERVERS", "")
    ps_servers = parse_server_list(ps_raw, name="TRAINMESH_PS_SERVERS") if ps_raw.strip() else []
    cuda = torch.cuda.is_available()
    return {
        "source": cluster.source,
        "rank": cluster.rank,
        "world_size": cluster.world_size,
        "local_rank": cluster.local_rank,
        "local_world_size": cluster.local_world_size,
        "node_rank": cluster.node_rank,
        "master_addr": cluster.master_addr,
        "master_port": cluster.master_port,
        "ps_servers": ps_servers,
        # What initialize() would pick by default; it adds a gloo side channel for CPU tensors on GPU.
        "backend": "nccl" if cuda else "gloo",
        "devices": list_devices(),
        "torch_version": torch.__version__,
        "cuda_available": cuda,
        "cuda_device_count": torch.cuda.device_count() if cuda else 0,
        "trainmesh_version": trainmesh.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def format_text(report: dict[str, Any]) -> str:
    """Human-readable lines, one ``name: value`` per fact."""
    lines = [
        f"cluster source:   {report['source']}",
        f"rank:             {report['rank']} of {report['world_size']}",
        f"local rank:       {report['local_rank']} of {report['local_world_size']}",
        f"node rank:        {report['node_rank']}",
        f"master:           {report['master_addr']}:{report['master_port']}",
        f"ps servers:       {', '.join(report['ps_servers']) or '(none)'}",
        f"backend:          {report['backend']}",
        f"devices:          {', '.join(report['devices']) or '(none)'}",
        f"torch:            {report['torch_version']}",
        f"cuda:             {'available' if report['cuda_available'] else 'not available'}"
        f" ({report['cuda_device_count']} devices)",
        f"trainmesh:        {report['trainmesh_version']}",
        f"OMP_NUM_THREADS:  {report['omp_num_threads'] or '(not set)'}",
    ]
    return "\n".join(lines)


def handle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the report; exit status 1 when the environment variables contradict each other."""
    try:
        report = collect()
        if args.peak:
            report.update(_measure_peak(args.peak, args.peak_seconds))
    except ValueError as exc:
        print(f"trainmesh env: error: {exc}", file=sys.stderr)
        return 1
    text = format_text(report)
    if args.peak:
        text += (
            f"\npeak ({report['peak_dtype']}):      {report['peak_flops'] / 1e9:.1f} GFLOP/s "
            f"(matmul probe, {report['peak_device']}; cached in {report['peak_cache']})"
        )
    print(json.dumps(report, indent=2) if args.json else text)
    return 0
