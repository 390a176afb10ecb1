"""``trainmesh export``: a sharded training checkpoint to the Hugging Face layout, on one process.

Reads the checkpoint tensor by tensor (memory: one tensor at a time) and writes
``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``
and the model's configs, published atomically. See :mod:`trainmesh.checkpoint.hf_export`.
"""

from __future__ import annotations

import argparse
import sys

_DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``trainmesh export``."""
    parser = subparsers.add_parser(
        "export",
        help="convert a sharded training checkpoint to the Hugging Face layout (from_pretrained loads it)",
        description="Convert the model weights of a trainmesh checkpoint (a step_* folder, or a checkpoint "
        "folder, whose latest complete checkpoint is taken) into the Hugging Face layout in OUT_DIR, on one "
        "process, one tensor at a time. A training checkpoint holds no model config: config.json (and "
        "generation_config.json) come from --config, else from the checkpoint's folder or the folder above "
        "it. Without a config the weights alone are written, under their checkpoint names, and tied weights "
        "are not recognised.",
    )
    parser.add_argument("checkpoint", metavar="CKPT_DIR", help="a trainmesh checkpoint (step folder or its parent)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created; a previous export is replaced)")
    parser.add_argument(
        "--config",
        metavar="DIR_OR_JSON",
        default=None,
        help="optional: a folder holding the model's config.json (e.g. the Hugging Face folder "
        "training started from), or that JSON file",
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", metavar="SIZE", help="largest output file, e.g. 5GB or 500MiB (default: 5GB)"
    )
    parser.add_argument(
        "--dtype", choices=_DTYPES, default=None, help="cast floating tensors to this dtype (default: as saved)"
    )
    return parser


def handle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from trainmesh.checkpoint.hf_export import export_pretrained

    try:
        out = export_pretrained(
            args.checkpoint,
            args.out_dir,
            config=args.config,
            max_shard_size=args.max_shard_size,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {out}", file=sys.stdout)
    return 0
