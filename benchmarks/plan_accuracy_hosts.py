"""plan_accuracy's shaped-link groups: its cases run on two hosts, one or two processes on each.

The hosts are network namespaces of this machine (``trainmesh.testing.cluster``: 198.18.0.0/24, no
default route), both links shaped to the same rate (``tbf``), and each process joins the job over
them (``tm.initialize`` with the first host as coordinator, gloo on the namespace's ``eth0``). The
processes run plan_accuracy's own ``_worker`` (the same steps, rounds and probes as on loopback);
the plan prices the same dry runs with the link measured between two such hosts
(``trainmesh.planner.calibrate_hosts``) as its inter-node link.

Run by plan_accuracy.py; this file is also the worker it starts in each host:

    python benchmarks/plan_accuracy_hosts.py --spec SPEC --rank R --coordinator ADDR:PORT --out DIR
"""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

RATE = "1gbit"  # the rate benchmarks/multihost.py shapes its hosts to
PORT = 29613


def measure_on_hosts(group: list, rounds: int, hardware, priority: bool, rate: str = RATE,
                     processes_per_host: int = 1, timeout: float = 1800) -> list[dict]:
    """Each rank's ``_worker`` result for ``group`` (one world size), ``processes_per_host`` processes on
    each namespace host, ranks numbered host by host (as torchrun numbers nodes)."""
    from trainmesh.testing.cluster import IFACE, Cluster

    n = group[0][0]
    if n % processes_per_host:
        raise ValueError(f"{n} processes do not split into hosts of {processes_per_host}")
    with Cluster(n // processes_per_host) as cluster, tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        cluster.wait_reachable()
        for host in cluster.hosts:
            host.shape(rate=rate)
        spec = Path(tmp) / "spec.pkl"
        spec.write_bytes(pickle.dumps({"cases": group, "rounds": rounds, "hardware": hardware.to_dict(),
                                       "priority": priority}))
        log = Path(tmp) / "log.txt"
        coordinator = f"{cluster.hosts[0].address}:{PORT}"
        env = {"GLOO_SOCKET_IFNAME": IFACE, "OMP_NUM_THREADS": "1", "TRAINMESH_TIMEOUT_S": "900"}
        with open(log, "w") as sink:
            # Two processes of one host talk over its own address, which stays inside the namespace
            # (unshaped, like loopback); only traffic between hosts crosses the shaped links. All stay
            # in this session, as run_distributed's do on loopback: with Linux autogroup the cores are
            # shared between sessions first, and a session per process made the core-sharing probe
            # read 2.6-12.7x for 4 processes where their steps ran at about 2.3x.
            procs = [host.popen([sys.executable, __file__, "--spec", str(spec),
                                 "--rank", str(host.index * processes_per_host + local),
                                 "--coordinator", coordinator, "--out", tmp],
                                env=env, stdout=sink, stderr=subprocess.STDOUT, new_session=False)
                     for host in cluster.hosts for local in range(processes_per_host)]
            try:
                for proc in procs:
                    proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                cluster.close()
                raise TimeoutError(f"the shaped-link group ran over {timeout} s; its log ends:\n"
                                   + log.read_text()[-3000:]) from None
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"a process of the shaped-link group failed ({[p.returncode for p in procs]}); "
                               "its log ends:\n" + log.read_text()[-3000:])
        return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(n)]


def _host_worker(spec_path: str, rank: int, coordinator: str, out: str) -> None:
    import torch

    import trainmesh as tm
    from plan_accuracy import _worker  # this file's directory is on the path: the benchmarks'
    from trainmesh.planner.hardware import Hardware

    spec = pickle.loads(Path(spec_path).read_bytes())
    torch.set_num_threads(1)
    tm.initialize(coordinator, num_processes=spec["cases"][0][0], process_id=rank)
    try:
        result = _worker(spec["cases"], spec["rounds"], Hardware.from_dict(spec["hardware"]), spec["priority"])
        (Path(out) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        tm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    _host_worker(args.spec, args.rank, args.coordinator, args.out)


if __name__ == "__main__":
    main()
