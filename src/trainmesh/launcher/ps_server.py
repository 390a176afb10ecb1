"""``trainmesh ps-server``: run one parameter server (``trainmesh.ps.serve``) in the foreground.

The options are ``python -m trainmesh.ps``'s own (the same parser), so the two never drift;
``--bind`` also accepts a bare ``HOST:PORT``. Workers reach the servers through
``TRAINMESH_PS_SERVERS=tcp://host1:port,tcp://host2:port`` (what ``tm.ParameterServerStrategy``
reads). A non-loopback ``--bind`` needs the shared secret in ``TRAINMESH_PS_SECRET`` (or a 0600
``--secret-file``); on loopback without one the server makes one and logs the file it wrote.
"""

from __future__ import annotations

import argparse


def _serve_parser() -> argparse.ArgumentParser:
    from trainmesh.ps import serve  # light: no pyzmq until the server starts

    return serve.build_parser()


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``trainmesh ps-server`` with ``trainmesh.ps.serve``'s options."""
    return subparsers.add_parser(
        "ps-server",
        parents=[_serve_parser()],
        conflict_handler="resolve",  # the parent parser's own -h/--help
        help="run one parameter server (for tm.ParameterServerStrategy)",
        description="Run one trainmesh parameter server until SIGTERM/SIGINT. It prints 'READY tcp://HOST:PORT' "
        "once serving. Give workers the addresses in TRAINMESH_PS_SERVERS (comma-separated).",
    )


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The ``python -m trainmesh.ps`` arguments equivalent to a parsed ``trainmesh ps-server``."""
    defaults = vars(_serve_parser().parse_args([]))
    bind = args.bind if "://" in args.bind else f"tcp://{args.bind}"
    argv = ["--bind", bind]
    for dest, default in defaults.items():
        value = getattr(args, dest)
        if dest == "bind" or value == default:
            continue
        flag = "--" + dest.replace("_", "-")  # every option of serve's parser is spelled like its dest
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def handle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Serve until stopped; the server's exit status."""
    from trainmesh.ps import serve

    return serve.main(serve_argv(args))
