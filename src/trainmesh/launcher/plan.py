"""``trainmesh plan``: size a run before renting it.

Two forms, one planner underneath (``trainmesh.planner``: dry runs of trainmesh's own
``parallelize`` on torch's fake process group):

    trainmesh plan --world-size 1024 --mesh pipe=8,data=16,model=8 --model llama-70b \\
        --zero 3 --activation-checkpointing full --micro-batch 1 --seq 4096 --device-memory 80GB
    trainmesh plan --world-size 64 --model llama-7b --seq 4096 --device-memory 80GB --search
    trainmesh plan --calibrate [--json hw.json]          # this machine's FLOP rate and link alpha/beta
    trainmesh plan --calibrate --host-link 1gbit        # ... and a shaped link between namespace hosts
    trainmesh plan mypkg.models:build_gpt --world-size 8 --micro-batch 4 --seq-len 2048 --budget 80GiB

The last form (a ``MODULE:FACTORY`` positional, no ``--mesh``/``--model``) prints the
data-parallel table: one row per ZeRO stage x checkpointing choice.
"""

from __future__ import annotations

import argparse
import json
import sys

_EXAMPLE = "the demo's character GPT (vocab 65, 8 layers, d_model 512, block 256; ~25M parameters)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``trainmesh plan``."""
    parser = subparsers.add_parser(
        "plan",
        help="plan per-rank memory, collectives and step time of a run (dry run on a fake process group)",
        description="Build the model on the meta device, run trainmesh's own parallelize (layouts, ZeRO, "
        "checkpointing) for representative ranks of an N-rank world on torch's fake process group, and report "
        "per-rank memory, collectives per mesh axis and an estimated step time.",
    )
    parser.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        nargs="?",
        help="importable zero-argument callable returning a torch.nn.Module",
    )
    parser.add_argument("--example", action="store_true", help=f"plan {_EXAMPLE}")
    parser.add_argument(
        "--model",
        default=None,
        help="llama-7b, llama-13b, llama-70b, gpt2-xl, tiny-llama, a transformers config.json, or module:function",
    )
    parser.add_argument("--world-size", type=int, default=None, help="number of processes (ranks)")
    parser.add_argument("--mesh", default=None, help="axis=size,... e.g. pipe=8,data=16,model=8 (default: data=N)")
    parser.add_argument("--micro-batch", type=int, default=None, help="samples per rank per forward (default 1)")
    parser.add_argument("--seq", "--seq-len", dest="seq_len", type=int, default=None, help="tokens per sample")
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="sequence parallelism beside the model axis (a seq=N mesh axis is context parallelism)",
    )
    parser.add_argument(
        "--zero",
        "--zero-stage",
        dest="zero_stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=None,
        help="ZeRO stage (default: all stages in the table form, 0 otherwise)",
    )
    parser.add_argument(
        "--precision",
        default=None,
        choices=("fp32", "bf16-mixed", "fp16-mixed", "bf16-true"),
        help="default bf16-mixed with --model/--mesh, fp32 in the table form",
    )
    parser.add_argument(
        "--activation-checkpointing",
        "--checkpointing",
        dest="checkpointing",
        default=None,
        metavar="POLICY",
        help="none, full, selective, every:K or a regex on module paths",
    )
    parser.add_argument(
        "--microbatches", type=int, default=None, help="pipeline microbatches per step (default: 2 x the pipe axis)"
    )
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, interleaved_1f1b, ...")
    parser.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd"))
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument(
        "--device-memory",
        "--budget",
        dest="budget",
        default=None,
        metavar="BYTES",
        help="per-rank device memory, e.g. 80GB or 8GiB",
    )
    parser.add_argument(
        "--hardware", default="h100", help="published figures (h100) or a JSON file written by --calibrate"
    )
    parser.add_argument(
        "--expert-parallel-size",
        type=int,
        default=None,
        metavar="EP",
        help="a mixture of experts' experts split over EP processes of the batch axis (planner/experts.py)",
    )
    parser.add_argument(
        "--replica-groups",
        type=int,
        default=None,
        metavar="G",
        help="torchft replica groups (trainmesh run --replica-groups G): plan one group of world-size/G "
        "processes, whose per-process memory is every group's, and the cross-group gradient all-reduce",
    )
    parser.add_argument("--search", action="store_true", help="rank meshes x ZeRO x checkpointing that fit")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine's FLOP rate and links")
    parser.add_argument(
        "--host-link",
        default=None,
        metavar="RATE",
        help="with --calibrate: also measure the link between two network-namespace hosts of this "
        "machine shaped to RATE (e.g. 1gbit; needs root), the plan's inter-node link",
    )
    parser.add_argument(
        "--processes-per-host",
        type=int,
        default=1,
        metavar="N",
        help="with --host-link: processes on each host (axes within a host use loopback)",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write JSON to PATH (no PATH: print JSON instead of the table)",
    )
    return parser


def _example_factory():
    from trainmesh.demo.char_gpt import CharGPT, GPTConfig

    return CharGPT(GPTConfig(vocab_size=65, block_size=256, n_layer=8, n_head=8, d_model=512))


def _load_factory(spec: str):
    from trainmesh.planner.models import model_factory

    if ":" not in spec:
        raise ValueError(f"expected MODULE:FACTORY, e.g. mypkg.models:build. Received: {spec!r}")
    return model_factory(spec)


def _emit(args, text: str, data: dict) -> None:
    if args.json == "-":
        print(json.dumps(data, indent=2))
        return
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)


def handle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the plan; exit 0, 2 on bad usage, 3 when a plan does not fit ``--device-memory``."""
    if args.calibrate:
        from trainmesh.planner.calibrate import calibrate
        from trainmesh.testing.cluster import ClusterUnavailable

        if args.processes_per_host < 1:
            parser.error(f"--processes-per-host must be at least 1. Received: {args.processes_per_host}")
        try:
            hardware = calibrate(host_link=args.host_link, processes_per_host=args.processes_per_host)
        except ClusterUnavailable as exc:
            parser.error(
                f"--host-link {args.host_link} needs network-namespace hosts, and this machine cannot make them: {exc}"
            )
        _emit(args, hardware.describe(), hardware.to_dict())
        return 0
    if args.world_size is None:
        parser.error("--world-size is required")
    if (
        args.model is not None
        or args.mesh is not None
        or args.search
        or args.expert_parallel_size
        or args.replica_groups
    ):
        return _handle_parallel(args, parser)
    return _handle_table(args, parser)


def _handle_parallel(args, parser) -> int:
    from trainmesh.planner import parse_bytes
    from trainmesh.planner.parallel import plan_parallel
    from trainmesh.planner.search import search

    if bool(args.model) + bool(args.factory) + bool(args.example) != 1:
        parser.error("give exactly one of --model, MODULE:FACTORY or --example")
    model = args.model or args.factory or _example_factory
    seq = args.seq_len if args.seq_len is not None or not args.example else 256
    world_size = args.world_size
    if args.replica_groups is not None:
        from trainmesh.planner.replica_groups import group_world_size

        if args.search:
            parser.error("--search plans one job; drop --replica-groups (search with --world-size of one group)")
        try:
            world_size = group_world_size(args.world_size, args.replica_groups)
        except ValueError as exc:
            parser.error(str(exc))
    kwargs = dict(
        world_size=world_size,
        precision=args.precision or "bf16-mixed",
        micro_batch=args.micro_batch or 1,
        seq_len=seq,
        optimizer=args.optimizer,
        hardware=args.hardware,
        grad_accum_steps=args.grad_accum_steps,
    )
    try:
        budget = parse_bytes(args.budget) if args.budget is not None else None
        if args.search:
            if budget is None:
                parser.error("--search needs --device-memory")
            if args.expert_parallel_size:
                parser.error("--search does not search expert parallelism; drop --expert-parallel-size")
            result = search(model, device_memory=budget, progress=lambda line: print(line, file=sys.stderr), **kwargs)
            _emit(args, result.table(), result.to_dict())
            return 0 if result.best is not None else 3
        plan = plan_parallel(
            model,
            mesh=args.mesh,
            zero_stage=args.zero_stage or 0,
            activation_checkpointing=args.checkpointing,
            device_memory=budget,
            microbatches=args.microbatches,
            schedule=args.schedule,
            sequence_parallel=args.sequence_parallel,
            expert_parallel_size=args.expert_parallel_size,
            **kwargs,
        )
    except (ValueError, TypeError) as exc:
        print(f"trainmesh plan: error: {exc}", file=sys.stderr)
        return 2
    text, data = plan.table(), plan.to_dict()
    if args.replica_groups is not None:
        from trainmesh.planner.replica_groups import replica_group_summary

        lines, data["replica_groups"] = replica_group_summary(plan, args.replica_groups)
        text = "\n".join([text, *lines])
    _emit(args, text, data)
    return 3 if plan.fits is False else 0


def _handle_table(args, parser) -> int:
    if bool(args.factory) == bool(args.example):
        parser.error("give exactly one of MODULE:FACTORY, --model or --example")
    if args.micro_batch is None:
        parser.error("--micro-batch is required")
    from trainmesh.planner import parse_bytes, plan

    try:
        factory = _example_factory if args.example else _load_factory(args.factory)
        budget = parse_bytes(args.budget) if args.budget is not None else None
    except (ValueError, ImportError, AttributeError) as exc:
        parser.error(str(exc))
    seq_len = args.seq_len if args.seq_len is not None or not args.example else 256
    checkpointing = None if args.checkpointing == "none" else args.checkpointing
    try:
        report = plan(
            factory,
            world_size=args.world_size,
            zero_stage=args.zero_stage,
            precision=args.precision or "fp32",
            micro_batch=args.micro_batch,
            seq_len=seq_len,
            activation_checkpointing=checkpointing,
            cpu_offload=args.cpu_offload,
            budget_bytes=budget,
            optimizer=args.optimizer,
            grad_accum_steps=args.grad_accum_steps,
        )
    except (ValueError, TypeError) as exc:
        print(f"trainmesh plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(report.to_json())
    else:
        print(report.table())
        if args.json:
            with open(args.json, "w") as f:
                f.write(report.to_json())
    return 0
