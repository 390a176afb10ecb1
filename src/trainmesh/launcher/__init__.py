"""The ``trainmesh`` command line: ``trainmesh run``, ``trainmesh env`` and later subcommands.

Each subcommand is one module here that provides ``add_parser(subparsers)`` and
``handle(args, parser)``; :mod:`trainmesh.launcher.cli` lists them in ``COMMANDS``.
"""

from .cli import main

__all__ = ["main"]
