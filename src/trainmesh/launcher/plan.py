"""``trainmesh plan``: per-rank memory of a model per ZeRO stage and checkpointing choice, before running.

``MODULE:FACTORY`` names an importable zero-argument callable returning a model; it is called on
the meta device, so nothing is allocated (``--example`` plans the demo's GPT instead).

    trainmesh plan mypkg.models:build_gpt --world-size 8 --micro-batch 4 --seq-len 2048 --budget 80GiB
"""

from __future__ import annotations

import argparse
import importlib
import sys

_EXAMPLE = "the demo's character GPT (vocab 65, 8 layers, d_model 512, block 256; ~25M parameters)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``trainmesh plan``."""
    parser = subparsers.add_parser(
        "plan", help="plan per-rank memory for each ZeRO stage and checkpointing choice",
        description="Build the model on the meta device (nothing allocated), count parameters, gradients and "
        "optimizer state, measure activations with a fake forward, and print per-rank bytes for each ZeRO "
        "stage x activation-checkpointing choice.")
    parser.add_argument("factory", metavar="MODULE:FACTORY", nargs="?",
                        help="importable zero-argument callable returning a torch.nn.Module")
    parser.add_argument("--example", action="store_true", help=f"plan {_EXAMPLE}")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel processes")
    parser.add_argument("--micro-batch", type=int, required=True, help="samples per process per forward")
    parser.add_argument("--seq-len", type=int, default=None, help="token ids per sample (Embedding-first models)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None, help="default: all stages")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed", "fp16-mixed", "bf16-true"))
    parser.add_argument("--checkpointing", default=None, metavar="POLICY",
                        help='activation checkpointing policy: full, selective, every:K or a regex on module paths')
    parser.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd"))
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--budget", default=None, metavar="BYTES", help="per-rank budget, e.g. 8GiB or 80GB")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def _example_factory():
    from trainmesh.demo.char_gpt import CharGPT, GPTConfig

    return CharGPT(GPTConfig(vocab_size=65, block_size=256, n_layer=8, n_head=8, d_model=512))


def _load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected MODULE:FACTORY, e.g. mypkg.models:build. Received: {spec!r}")
    target = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec} is not callable")
    return target


def handle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the plan; exit 0, or 2 on bad usage (usage errors go through ``parser.error``)."""
    if bool(args.factory) == bool(args.example):
        parser.error("give exactly one of MODULE:FACTORY or --example")
    from trainmesh.planner import parse_bytes, plan

    try:
        factory = _example_factory if args.example else _load_factory(args.factory)
        budget = parse_bytes(args.budget) if args.budget is not None else None
    except (ValueError, ImportError, AttributeError) as exc:
        parser.error(str(exc))
    seq_len = args.seq_len if args.seq_len is not None or not args.example else 256
    try:
        report = plan(factory, world_size=args.world_size, zero_stage=args.zero_stage, precision=args.precision,
                      micro_batch=args.micro_batch, seq_len=seq_len, activation_checkpointing=args.checkpointing,
                      cpu_offload=args.cpu_offload, budget_bytes=budget, optimizer=args.optimizer,
                      grad_accum_steps=args.grad_accum_steps)
    except (ValueError, TypeError) as exc:
        print(f"trainmesh plan: error: {exc}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else report.table())
    return 0
