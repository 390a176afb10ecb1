"""``trainmesh lighthouse`` (or ``python -m trainmesh.ft.lighthouse``): torchft's Lighthouse, the quorum of
replica groups, in the foreground.

It binds where ``--bind`` says (default loopback: a job across hosts passes its own interface), prints
its URL once it listens, and stops on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import threading


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--bind", default="127.0.0.1:29510", help="host:port to listen on (port 0: any free one)")
    parser.add_argument("--min-replicas", type=int, default=1, help="groups needed before a quorum forms")
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=1000,
        help="how long a quorum waits for groups it knew before forming without them",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms", type=int, default=2000, help="a group silent this long is dropped from the quorum"
    )
    return parser


def serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT; prints ``[trainmesh] lighthouse listening: URL`` once listening."""
    if args.min_replicas < 1:
        raise ValueError(f"--min-replicas must be >= 1. Received: --min-replicas={args.min_replicas}")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    port = server.address().rsplit(":", 1)[1]
    host = args.bind.rsplit(":", 1)[0].strip("[]")
    print(f"[trainmesh] lighthouse listening: http://{host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="python -m trainmesh.ft.lighthouse", description=__doc__))
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
