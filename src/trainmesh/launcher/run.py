"""``trainmesh run``: start N worker processes per node through torchrun's elastic agent.

This module only translates trainmesh's options into a ``torch.distributed.run`` argument
list and runs it in this process; spawning, rendezvous, restarts and failure reporting are
torchrun's. Workers find their rank in the torchrun variables (``RANK``, ``WORLD_SIZE``, ...)
that :func:`trainmesh.initialize` reads.

On several nodes each node must advertise an address the others can reach: torch's default,
the host name, resolves to a loopback address on many machines (and on network namespaces
that share one host name). So unless ``--local-addr`` says otherwise, a node uses the address
of its interface that routes to the rendezvous host (see :func:`choose_local_addr`), and
gloo, which otherwise also binds to what the host name resolves to, is pointed at that
interface through ``GLOO_SOCKET_IFNAME``.

With ``--servers K`` it first starts K local parameter servers (``trainmesh.ps.LocalCluster``),
hands their addresses to the workers in ``TRAINMESH_PS_SERVERS`` (where
``tm.ParameterServerStrategy`` finds them), and, unless the user set one, a new random secret in
``TRAINMESH_PS_SECRET``, and stops them when the workers are done.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import socket
import struct
import sys
from pathlib import Path
from typing import Iterator, Mapping

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


# A Kubeflow PyTorchJob sets these on every pod (torchrun reads them as its defaults, PET_ for
# "PyTorch elastic"): node count, this pod's node rank, and where node 0 listens.
_PET = ("PET_NNODES", "PET_NODE_RANK", "PET_RDZV_ENDPOINT", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_RDZV_ID")


def apply_pytorchjob_env(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> list[str]:
    """Fill ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint`` and ``--rdzv-id`` that the command
    line left unset from a PyTorchJob's ``PET_*`` variables; returns what was taken, for the log.

    Explicit options win. ``PET_RDZV_ENDPOINT`` (elastic jobs) is preferred, else
    ``PET_MASTER_ADDR:PET_MASTER_PORT`` (node 0's pod): trainmesh always uses the c10d rendezvous,
    which node 0 serves there.
    """
    env = os.environ if environ is None else environ
    taken = []
    if str(args.nnodes) == "1" and env.get("PET_NNODES"):
        args.nnodes = node_range(env["PET_NNODES"])
        taken.append(f"--nnodes {args.nnodes}")
    if args.node_rank is None and env.get("PET_NODE_RANK"):
        args.node_rank = _non_negative_int(env["PET_NODE_RANK"])
        taken.append(f"--node-rank {args.node_rank}")
    if args.rdzv_endpoint is None and nodes_min_max(args.nnodes)[1] > 1:
        endpoint = env.get("PET_RDZV_ENDPOINT")
        if endpoint:
            check_endpoint(endpoint, "PET_RDZV_ENDPOINT")
        elif env.get("PET_MASTER_ADDR"):
            from trainmesh.runtime.addresses import env_host, env_port

            endpoint = f"{env_host(env, ('PET_MASTER_ADDR',))}:{env_port(env, ('PET_MASTER_PORT',)) or 29400}"
        if endpoint:
            args.rdzv_endpoint = endpoint
            taken.append(f"--rdzv-endpoint {endpoint}")
    if getattr(args, "rdzv_id", None) is None and env.get("PET_RDZV_ID"):
        args.rdzv_id = env["PET_RDZV_ID"]
        taken.append(f"--rdzv-id {args.rdzv_id}")
    return taken


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The ``torch.distributed.run`` command line equivalent to a parsed ``trainmesh run``."""
    argv = ["--nproc-per-node", str(args.nproc_per_node), "--nnodes", str(args.nnodes)]
    if nodes_min_max(args.nnodes)[1] == 1 and args.rdzv_endpoint is None:
        # A c10d store on a port the OS picks: two jobs on one machine never collide.
        argv.append("--standalone")
    else:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
        if args.rdzv_id is not None:
            argv += ["--rdzv-id", args.rdzv_id]
        conf = [args.rdzv_conf] if getattr(args, "rdzv_conf", None) else []
        if args.node_rank is not None:
            # c10d assigns node ranks itself; what a fixed node rank can decide is who serves the
            # store, which is more reliable than torch's guess from the host name.
            conf.insert(0, f"is_host={int(args.node_rank == 0)}")
        if conf:
            argv += ["--rdzv-conf", ",".join(conf)]
    if getattr(args, "local_addr", None) is not None:
        argv += ["--local-addr", args.local_addr]
    if args.max_restarts is not None:
        argv += ["--max-restarts", str(args.max_restarts)]
    if args.monitor_interval is not None:
        argv += ["--monitor-interval", str(args.monitor_interval)]
    if args.module:
        argv.append("--module")
    return argv + [args.script, *args.script_args]


def choose_local_addr(rdzv_endpoint: str) -> str:
    """The address of this machine's interface that routes to the rendezvous host.

    A UDP socket's ``connect()`` only asks the kernel for a route; no packet is sent.

    >>> choose_local_addr("127.0.0.1:29400")
    '127.0.0.1'
    """
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(rdzv_endpoint, default_port=29400)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ValueError(
            f"cannot resolve the rendezvous host {host!r} ({exc}). Received: --rdzv-endpoint {rdzv_endpoint}"
        ) from None
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(sockaddr)
            except OSError as exc:
                errors.append(f"{sockaddr[0]}: {exc}")
                continue
            return probe.getsockname()[0]
    raise ValueError(
        f"no route from this machine to the rendezvous host ({'; '.join(errors)}). "
        f"Received: --rdzv-endpoint {rdzv_endpoint}"
    )


def interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 ``address`` (Linux), or None."""
    try:
        import fcntl
    except ImportError:  # not a Unix
        return None
    try:
        address = socket.gethostbyname(address)
    except OSError:
        return None
    siocgifaddr = 0x8915  # <linux/sockios.h>: read an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a host name


def resolve_local_addr(args: argparse.Namespace) -> str | None:
    """``--local-addr`` as given, else chosen for a multi-node job (None on one node: torch's default)."""
    if args.local_addr is not None or nodes_min_max(args.nnodes)[1] == 1:
        return args.local_addr
    return choose_local_addr(args.rdzv_endpoint)


def worker_env(
    nproc_per_node: int,
    environ: Mapping[str, str] | None = None,
    local_addr: str | None = None,
    multi_node: bool = False,
) -> dict[str, str]:
    """Variables to add to the workers' environment (none of them overrides the user's)."""
    environ = os.environ if environ is None else environ
    extra = {}
    if local_addr is not None and not _is_loopback(local_addr) and "GLOO_SOCKET_IFNAME" not in environ:
        # gloo advertises what the host name resolves to, often 127.0.0.1 (or an address on
        # another network); peers on other nodes then cannot connect. Its interface is the one
        # this node already advertises to the rendezvous. (NCCL picks its interfaces well itself.)
        interface = interface_of(local_addr)
        if interface is not None:
            extra["GLOO_SOCKET_IFNAME"] = interface
    if multi_node and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in environ:
        # Read by the agent (this process). With the agent's store shared with the workers, a
        # node that stays rank 0 across a restart keeps last round's store address and never
        # publishes it for the new round, so a replacement node (a host that died and came back)
        # waits for it forever (torch 2.14). Unshared, every round publishes a fresh one.
        extra["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if not environ.get("OMP_NUM_THREADS", "").strip():
        # Share the cores instead of letting every worker start one thread per core; torchrun's
        # own default of 1 (with a warning) wastes cores when there are more than workers. An empty
        # value counts as unset: libgomp rejects it and every worker then takes every core.
        extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    return extra


@contextlib.contextmanager
def _environ_added(extra: Mapping[str, str]) -> Iterator[None]:
    """Add ``extra`` to ``os.environ`` (which workers inherit) and remove it afterwards,
    so calling :func:`trainmesh.launcher.main` from Python leaves the caller's environment alone."""
    before = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


def _exit_status(exitcode: int) -> int:
    # A worker killed by signal k reports -k; shells report that as 128 + k.
    return 128 - exitcode if exitcode < 0 else exitcode or 1


def handle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Launch the workers; return 0, or the first failed worker's exit status."""
    try:
        from_pytorchjob = apply_pytorchjob_env(args)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(
            f"bad PyTorchJob variable ({exc}). Received: "
            + ", ".join(f"{k}={os.environ[k]}" for k in _PET if k in os.environ)
        )
    if from_pytorchjob:
        print(f"[trainmesh] from the PyTorchJob environment: {' '.join(from_pytorchjob)}", file=sys.stderr, flush=True)
    _validate(args, parser)
    replica_groups.check(args, parser)
    if replica_groups.starts_groups(args):  # a Lighthouse and one launch per group, on this machine
        return replica_groups.run_local_groups(args, parser)
    # Imported here so `trainmesh --help` and `trainmesh env` do not pay for torchrun.
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        args.local_addr = resolve_local_addr(args)
    except ValueError as exc:
        parser.error(str(exc))
    if nodes_min_max(args.nnodes)[1] > 1:
        print(f"[trainmesh] this node advertises {args.local_addr} to the other nodes", file=sys.stderr, flush=True)
    with _parameter_servers(args.servers, num_workers=args.nproc_per_node * nodes_min_max(args.nnodes)[1]) as ps_env:
        with _environ_added(
            {
                **worker_env(
                    args.nproc_per_node, local_addr=args.local_addr, multi_node=nodes_min_max(args.nnodes)[1] > 1
                ),
                **ps_env,
                **replica_groups.worker_env(args),
            }
        ):
            try:
                torchrun.main(torchrun_argv(args))
            except ChildFailedError as failed:
                print(failed, file=sys.stderr)
                _, failure = failed.get_first_failure()
                return _exit_status(failure.exitcode)
    return 0


@contextlib.contextmanager
def _parameter_servers(count: int | None, num_workers: int) -> Iterator[dict[str, str]]:
    """Run ``count`` local parameter servers for the job's lifetime; yields the workers' variables."""
    if not count:
        yield {}
        return
    from trainmesh.ps.auth import SECRET_ENV, resolve_secret
    from trainmesh.ps.cluster import LocalCluster
    from trainmesh.ps.strategy import SERVERS_ENV

    try:
        given = resolve_secret()  # the user's (TRAINMESH_PS_SECRET or _FILE), which the workers read too
    except ValueError as error:  # e.g. a secret file others may read
        raise SystemExit(f"trainmesh run: {error}") from None
    cluster = LocalCluster(count, num_workers=num_workers, secret=given)  # else a new one for this job
    try:
        print(f"[trainmesh] {count} parameter server(s): {', '.join(cluster.addresses)}", file=sys.stderr, flush=True)
        # The job's secret reaches only the job's processes: the workers' environment.
        yield {SERVERS_ENV: ",".join(cluster.addresses), **({} if given else {SECRET_ENV: cluster.secret})}
    finally:
        cluster.stop()
