"""``trainmesh run``'s fault-tolerant replica-group options (issue 45, ``trainmesh.ft``).

* ``--replica-group R --lighthouse URL``: this launch is replica group R of a job whose Lighthouse
  listens at URL. The workers receive ``TRAINMESH_REPLICA_GROUP`` and ``TORCHFT_LIGHTHOUSE`` (and
  ``TRAINMESH_REPLICA_GROUPS`` with ``--replica-groups G``), which ``tm.ReplicaGroups()`` reads. Each
  group is its own torchrun job (its own rendezvous): one group's failure, and its restart under
  ``--max-restarts``, leave the others' processes alone, which is the point.
* ``--replica-groups G`` alone, on one machine: a Lighthouse on loopback (a free port) for the job's
  lifetime, and G such launches, ``-n N/G`` processes each. The exit status is the first failed
  group's, once every group has ended (the others go on without it).

A replica group is one process or several (``-n 2 --replica-group R``; ``-n 4 --replica-groups 2``:
two groups of two): inside a group any layout runs (ZeRO, TP, ...), and rank r of each group is paired
with rank r of the others for the cross-group gradient average and for recovery.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from trainmesh.ft.replica_config import LIGHTHOUSE_ENV, REPLICA_GROUP_ENV  # the variables the groups read

REPLICA_GROUPS_ENV = "TRAINMESH_REPLICA_GROUPS"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fault-tolerant replica groups (torchft; pip install 'trainmesh[ft]')")
    group.add_argument(
        "--replica-group", type=int, default=None, metavar="R", help="this launch is replica group R (from 0)"
    )
    group.add_argument(
        "--replica-groups",
        type=int,
        default=None,
        metavar="G",
        help="the job's number of replica groups; alone, on one machine: start a Lighthouse and G groups",
    )
    group.add_argument(
        "--lighthouse", default=None, metavar="URL", help=f"the Lighthouse's URL (default ${LIGHTHOUSE_ENV})"
    )


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Usage errors, before any process or server starts."""
    group, groups = args.replica_group, args.replica_groups
    if groups is not None and groups < 1:
        parser.error(f"--replica-groups must be >= 1. Received: --replica-groups {groups}")
    if group is None and groups is None:
        if args.lighthouse is not None:
            parser.error("--lighthouse needs --replica-group R (or --replica-groups G to start the groups here)")
        return
    if group is not None:
        if group < 0 or (groups is not None and group >= groups):
            parser.error(f"--replica-group must be in [0, --replica-groups). Received: --replica-group {group}")
        if not (args.lighthouse or os.environ.get(LIGHTHOUSE_ENV)):
            parser.error(f"--replica-group needs --lighthouse URL (or ${LIGHTHOUSE_ENV}): the job's Lighthouse")
    else:
        if args.nnodes != "1":
            parser.error(
                "--replica-groups G alone starts a Lighthouse and the groups on this machine; on several "
                "machines start `trainmesh lighthouse` and each group with --replica-group R --lighthouse URL. "
                f"Received: --nnodes {args.nnodes}"
            )
        if args.nproc_per_node % groups:
            parser.error(
                f"-n must be a multiple of --replica-groups. Received: -n {args.nproc_per_node} --replica-groups {groups}"
            )


def starts_groups(args: argparse.Namespace) -> bool:
    """``--replica-groups G`` without ``--replica-group``: this launch starts the Lighthouse and the groups."""
    return args.replica_groups is not None and args.replica_group is None


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """What one group's workers receive (nothing without ``--replica-group``)."""
    if args.replica_group is None:
        return {}
    env = {REPLICA_GROUP_ENV: str(args.replica_group)}
    if args.lighthouse:
        env[LIGHTHOUSE_ENV] = args.lighthouse
    if args.replica_groups is not None:
        env[REPLICA_GROUPS_ENV] = str(args.replica_groups)
    return env


def group_argv(args: argparse.Namespace, group: int, url: str) -> list[str]:
    """``trainmesh run`` arguments of one group's launch."""
    argv = ["-n", str(args.nproc_per_node // args.replica_groups), "--replica-group", str(group)]
    argv += ["--replica-groups", str(args.replica_groups), "--lighthouse", url]
    if args.max_restarts is not None:
        argv += ["--max-restarts", str(args.max_restarts)]
    if args.monitor_interval is not None:
        argv += ["--monitor-interval", str(args.monitor_interval)]
    if args.module:
        argv.append("--module")
    return argv + [args.script, *args.script_args]


def run_local_groups(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """A Lighthouse on loopback and one ``trainmesh run --replica-group g`` per group; waits for all."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        parser.error("--replica-groups needs torchft: pip install 'trainmesh[ft]'")
    # min_replicas 1: a group alone goes on (ReplicaGroups(min_replicas=...) is the job's own rule).
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    url = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    print(f"[trainmesh] lighthouse {url}; {args.replica_groups} replica groups", file=sys.stderr, flush=True)
    launches = []
    try:
        for group in range(args.replica_groups):
            command = [sys.executable, "-m", "trainmesh", "run", *group_argv(args, group, url)]
            launches.append(subprocess.Popen(command))
        codes = [launch.wait() for launch in launches]
    finally:
        for launch in launches:
            if launch.poll() is None:  # this launcher is ending early (Ctrl-C): its groups end with it
                launch.terminate()
                launch.wait()
        lighthouse.shutdown()
    failed = [code for code in codes if code != 0]
    return failed[0] if failed else 0
