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
import os
import sys
from typing import Iterator, Mapping

from . import replica_groups
from .node_address import _is_loopback, choose_local_addr, interface_of
from .pytorchjob_env import _PET, apply_pytorchjob_env
from .run_options import _validate, add_parser, check_endpoint, node_range, nodes_min_max, positive_int


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


# Kept importable from here, where callers and tests have always found them.
__all__ = [
    "add_parser",
    "apply_pytorchjob_env",
    "check_endpoint",
    "choose_local_addr",
    "handle",
    "interface_of",
    "node_range",
    "nodes_min_max",
    "positive_int",
    "resolve_local_addr",
    "torchrun_argv",
    "worker_env",
]
