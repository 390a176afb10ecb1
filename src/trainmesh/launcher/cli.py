"""Entry point of the ``trainmesh`` command: a top-level parser plus a registry of subcommands.

A subcommand is a module with two functions (see :class:`Command`); adding one (``demo``,
``plan``, ``plot``, ``ps-server``, ...) means writing that module and listing it in
:data:`COMMANDS`. Nothing else here changes.
"""

from __future__ import annotations

import argparse
from typing import Protocol, Sequence

import trainmesh

from . import demo, env_report, export, lighthouse, plan, plot, ps_server, run


class Command(Protocol):
    """What a subcommand module provides."""

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        """Add this command's parser to ``subparsers`` and return it."""

    def handle(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        """Run the command; return the process exit status. Usage errors go to ``parser.error``."""


# Order is the order ``trainmesh --help`` lists them in.
# lighthouse: torchft's quorum server for trainmesh.ft's replica groups (issue 45)
COMMANDS: tuple[Command, ...] = (run, demo, env_report, plan, plot, export, ps_server, lighthouse)


def build_parser() -> argparse.ArgumentParser:
    """The full ``trainmesh`` parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="trainmesh",
        description="Distributed training for PyTorch: launch jobs and inspect the environment.",
    )
    parser.add_argument("--version", action="version", version=f"trainmesh {trainmesh.__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command", required=True)
    for command in COMMANDS:
        sub = command.add_parser(subparsers)
        # Each subcommand validates against its own parser so errors print its usage line.
        sub.set_defaults(handle=command.handle, command_parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the chosen subcommand, return its exit status.

    Bad usage raises ``SystemExit(2)`` with an argparse message, as ``--help`` raises ``SystemExit(0)``.
    """
    args = build_parser().parse_args(argv)
    return args.handle(args, args.command_parser)
