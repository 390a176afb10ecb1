"""``trainmesh run``'s command line: the argument types, the parser, and the checks that refuse a bad
command (with the value received) before any process, rendezvous or connection starts.

It exists apart from ``run.py`` so that what the user may type, and how a mistake is reported,
reads in one place, away from how the workers are then launched.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from . import replica_groups


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1. Received: {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0. Received: {value}")
    return value


def node_range(text: str) -> str:
    """``--nnodes``: ``N`` or ``MIN:MAX`` (elastic, as torchrun takes it); returned as given, checked."""
    parts = str(text).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low = high = 0
    if len(parts) > 2 or not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"must be N or MIN:MAX with 1 <= MIN <= MAX. Received: {text}")
    return str(low) if low == high else f"{low}:{high}"


def nodes_min_max(nnodes: str | int) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:2"`` -> (1, 2)."""
    parts = str(nnodes).split(":")
    return int(parts[0]), int(parts[-1])


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0. Received: {value}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``trainmesh run``."""
    parser = subparsers.add_parser(
        "run",
        help="launch a training script on N processes per node (via torchrun)",
        description="Launch SCRIPT on N processes per node with torchrun's elastic agent "
        "and c10d rendezvous. Arguments after SCRIPT are passed to it untouched.",
    )
    parser.add_argument(
        "-n", "--nproc-per-node", type=positive_int, required=True, metavar="N", help="worker processes on this node"
    )
    parser.add_argument(
        "--nnodes",
        type=node_range,
        default="1",
        metavar="N|MIN:MAX",
        help="number of nodes, or MIN:MAX for an elastic job that goes on with as few as "
        "MIN nodes when others are lost (default: 1)",
    )
    parser.add_argument(
        "--node-rank",
        type=_non_negative_int,
        default=None,
        metavar="R",
        help="this node's index; node 0 hosts the rendezvous store at --rdzv-endpoint",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="rendezvous address, required when --nnodes > 1 (default on one node: a free local port)",
    )
    parser.add_argument(
        "--local-addr",
        default=None,
        metavar="ADDR",
        help="address of this node that the other nodes can reach (default with "
        "--nnodes > 1: the address of the interface that routes to the rendezvous host)",
    )
    parser.add_argument(
        "--rdzv-id",
        default=None,
        metavar="ID",
        help="job id shared by all nodes of one job (ignored on a standalone node)",
    )
    parser.add_argument(
        "--rdzv-conf",
        default=None,
        metavar="KEY=VALUE,...",
        help="extra c10d rendezvous settings, as torchrun takes them (e.g. "
        "join_timeout=600,last_call_timeout=30,close_timeout=30)",
    )
    parser.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=None,
        metavar="K",
        help="restart the worker group up to K times after a failure (default: 0)",
    )
    parser.add_argument(
        "--monitor-interval",
        type=_positive_float,
        default=None,
        metavar="S",
        help="seconds between worker health checks",
    )
    parser.add_argument(
        "--servers",
        type=positive_int,
        default=None,
        metavar="K",
        help="also start K local parameter servers for tm.ParameterServerStrategy "
        "(addresses passed to the workers in TRAINMESH_PS_SERVERS; one node only)",
    )
    replica_groups.add_arguments(parser)  # --replica-group(s), --lighthouse: trainmesh.ft (issue 45)
    parser.add_argument("-m", "--module", action="store_true", help="treat SCRIPT as a module name, like `python -m`")
    parser.add_argument("script", metavar="SCRIPT", help="training script path (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments for SCRIPT")
    return parser


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    max_nodes = nodes_min_max(args.nnodes)[1]
    if args.node_rank is not None and args.node_rank >= max_nodes:
        parser.error(f"--node-rank must be < --nnodes. Received: --node-rank {args.node_rank} --nnodes {args.nnodes}")
    if max_nodes > 1 and args.rdzv_endpoint is None:
        parser.error(f"--rdzv-endpoint HOST:PORT is required when --nnodes > 1. Received: --nnodes {args.nnodes}")
    if args.rdzv_conf is not None and not all("=" in item for item in args.rdzv_conf.split(",")):
        parser.error(f"--rdzv-conf must be KEY=VALUE[,KEY=VALUE...]. Received: --rdzv-conf {args.rdzv_conf}")
    if args.servers is not None and max_nodes > 1:
        parser.error(
            "--servers starts servers on this machine, bound to 127.0.0.1, which other nodes cannot "
            "reach; on several nodes start them with `trainmesh ps-server` and set TRAINMESH_PS_SERVERS. "
            f"Received: --servers {args.servers} --nnodes {args.nnodes}"
        )
    if not args.module and not Path(args.script).is_file():
        parser.error(f"script not found: {args.script!r}")
    if args.rdzv_endpoint is not None:
        try:
            check_endpoint(args.rdzv_endpoint, "--rdzv-endpoint")
        except ValueError as exc:
            parser.error(str(exc))
    if args.local_addr is not None:
        _check_local_addr(args.local_addr, parser)
    _check_ps_servers(args, parser)


def check_endpoint(endpoint: str, name: str) -> tuple[str, int]:
    """A rendezvous ``HOST:PORT`` (port 29400 when left out): an empty host or a port outside
    1..65535 is a ValueError naming ``name`` and the value; torch's own parser must accept it too."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from trainmesh.runtime.addresses import split_host_port

    received = f"{name} {endpoint}" if name.startswith("--") else f"{name}={endpoint!r}"
    try:
        host, port = split_host_port(endpoint, 29400)
        parse_rendezvous_endpoint(endpoint, default_port=29400)
    except ValueError as exc:
        raise ValueError(f"{name} must be HOST:PORT ({exc}). Received: {received}") from None
    return host, port


def _check_ps_servers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Parameter-server addresses handed to the workers are checked here, before any worker starts."""
    from trainmesh.runtime.addresses import parse_server_list

    raw = os.environ.get("TRAINMESH_PS_SERVERS")
    if raw is not None and raw.strip() and args.servers is None:
        try:
            parse_server_list(raw, name="TRAINMESH_PS_SERVERS")
        except ValueError as exc:
            parser.error(str(exc))


def _check_local_addr(address: str, parser: argparse.ArgumentParser) -> None:
    """An address no local interface holds would hang the other nodes until their timeout."""
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        parser.error(f"--local-addr does not resolve ({exc}). Received: --local-addr {address}")
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((sockaddr[0], 0))
                return
            except OSError:
                continue
    parser.error(
        f"--local-addr must be an address of this machine (no local interface holds it). "
        f"Received: --local-addr {address}"
    )
