"""A Kubeflow PyTorchJob's ``PET_*`` variables as ``trainmesh run`` options.

It exists apart from ``run_options.py`` because these come from the environment a job operator
sets, not from the command line, and only fill what the command line left unset.
"""

from __future__ import annotations

import argparse
import os
from typing import Mapping

from .run_options import _non_negative_int, check_endpoint, node_range, nodes_min_max


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
