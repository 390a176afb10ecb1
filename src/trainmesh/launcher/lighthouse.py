"""``trainmesh lighthouse``: torchft's Lighthouse for fault-tolerant replica groups (``trainmesh.ft``).

The options are ``python -m trainmesh.ft.lighthouse``'s own; torchft is imported only when it runs
(``pip install 'trainmesh[ft]'``).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from trainmesh.ft.lighthouse import add_arguments

    return add_arguments(
        subparsers.add_parser(
            "lighthouse",
            help="run torchft's Lighthouse (the quorum of fault-tolerant replica groups)",
            description="Run torchft's Lighthouse until SIGTERM/SIGINT; it prints its URL once listening. Replica "
            "groups reach it through ReplicaGroups(lighthouse=URL) or $TORCHFT_LIGHTHOUSE.",
        )
    )


def handle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from trainmesh.ft.lighthouse import serve

    if args.min_replicas < 1:
        parser.error(f"--min-replicas must be >= 1. Received: --min-replicas={args.min_replicas}")
    try:
        import torchft  # noqa: F401
    except ImportError:
        parser.error("trainmesh lighthouse needs torchft: pip install 'trainmesh[ft]'")
    return serve(args)
