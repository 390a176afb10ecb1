"""``run_distributed`` across hosts: a function on every rank of a job spread over network-namespace hosts.

``run_on_hosts("package.module:function", args, world_size, processes_per_host=2, rate="1gbit")`` makes a
:class:`~trainmesh.testing.cluster.Cluster` of ``world_size / processes_per_host`` hosts, shapes their links
to ``rate`` (``tbf``), starts each rank in its host (ranks numbered host by host, as torchrun numbers
nodes), joins them into one job over the hosts' addresses (``tm.initialize``, gloo on the namespace's
``eth0``), runs the function with ``args`` and returns each rank's result, in rank order. Arguments and
results travel pickled, so both must be picklable and the function importable (``path`` adds entries to
the ranks' ``sys.path``, e.g. a benchmark's directory).

Every rank stays in the caller's session (``Host.popen(new_session=False)``), as ``run_distributed``'s do:
where Linux autogroup is on, the cores are shared between sessions first, and a session per rank made
a 4-process job's core-sharing probe read 2.6-12.7x where its steps ran at about 2.3x.
"""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

PORT = 29613


def run_on_hosts(
    target: str,
    args: tuple,
    world_size: int,
    *,
    processes_per_host: int = 1,
    rate: str | None = None,
    path: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 1800,
) -> list[Any]:
    """Each rank's ``target(*args)`` (``"module:function"``), ``processes_per_host`` ranks on each namespace host."""
    from .cluster import IFACE, Cluster

    if world_size % processes_per_host:
        raise ValueError(
            f"world_size={world_size} does not split into hosts of processes_per_host={processes_per_host}"
        )
    with Cluster(world_size // processes_per_host) as cluster, tempfile.TemporaryDirectory(prefix="host-job-") as tmp:
        cluster.wait_reachable()
        for host in cluster.hosts if rate else ():
            host.shape(rate=rate)
        spec = Path(tmp) / "spec.pkl"
        spec.write_bytes(
            pickle.dumps(
                {
                    "target": target,
                    "args": args,
                    "world_size": world_size,
                    "path": list(path),
                    "coordinator": f"{cluster.hosts[0].address}:{PORT}",
                }
            )
        )
        log = Path(tmp) / "log.txt"
        # Ranks of one host talk over its own address, which stays inside the namespace (unshaped, like
        # loopback); only traffic between hosts crosses the shaped links.
        rank_env = {"GLOO_SOCKET_IFNAME": IFACE, "OMP_NUM_THREADS": "1", **(env or {})}
        with open(log, "w") as sink:
            procs = [
                host.popen(
                    [sys.executable, "-m", __name__, str(spec), str(host.index * processes_per_host + local), tmp],
                    env=rank_env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    new_session=False,
                )
                for host in cluster.hosts
                for local in range(processes_per_host)
            ]
            deadline = time.monotonic() + timeout  # for the whole job, not for each rank in turn
            try:
                for proc in procs:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                cluster.close()
                raise TimeoutError(
                    f"{target} on {world_size} ranks over hosts ran over {timeout} s; its log ends:\n"
                    + log.read_text()[-3000:]
                ) from None
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(
                f"a rank of {target} over hosts failed (exit codes {[p.returncode for p in procs]}); "
                "its log ends:\n" + log.read_text()[-3000:]
            )
        return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def _rank_main(spec_path: str, rank: int, out: str) -> None:
    import torch

    import trainmesh as tm

    spec = pickle.loads(Path(spec_path).read_bytes())
    sys.path[:0] = spec["path"]
    module, name = spec["target"].split(":")
    function = getattr(importlib.import_module(module), name)
    torch.set_num_threads(1)
    tm.initialize(spec["coordinator"], num_processes=spec["world_size"], process_id=rank)
    try:
        result = function(*spec["args"])
        (Path(out) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        tm.shutdown()


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
