"""Communication where bandwidth is scarce: hierarchy, compression and auto on 2 network-namespace hosts.

    python benchmarks/communication.py [--json PATH] [--quick] [--rounds R] [--steps S] [--skip-ssp | --ssp-only]

Needs root (CAP_NET_ADMIN) for ``trainmesh.testing.cluster``: two hosts (network namespaces on a
bridge, 198.18.0.0/24), each running ``trainmesh run --nnodes 2 --nproc-per-node P`` (c10d
rendezvous at host 0), exactly as on two machines. Layouts: 2 hosts x 4 processes, unshaped
and with each host's link shaped to 100 Mbit/s (tc tbf; this kernel has no netem, so no added
delay), and 2 hosts x 2 at 100 Mbit/s.

In one launch every variant trains its own copy of the same MLP (1.3M parameters, 5.2 MB of fp32
gradients) from the same seed on the same batches, through the Trainer's installer
(``trainmesh.trainer.communication``), interleaved: each round runs S timed steps of every
variant, one variant after another (the order rotates per round and per pass), each timed step
right after W untimed ones of its own variant, so that adjacent steps of two variants share the
machine's load and no variant's time depends on which one ran before it.
Variants:

* ``flat``: fp32, DDP's own flat all-reduce (``hierarchical_allreduce=False``): the baseline of
  the byte figures (what the issue measured against);
* ``hier``: fp32 hierarchical all-reduce over the discovered hosts (trainmesh's default on >1 host):
  the baseline of the step-time and loss figures (the stronger fp32 side);
* ``int8``: two-phase int8 across hosts (fp32 inside); ``topk1``: top-k 1% (all-gather of
  fp32 values with 16-bit block offsets); ``powersgd``: PowerSGD rank 2 (fp32 sum within a host, P and Q
  exchanged between the hosts' leaders only, factors sent back within each host);
* ``auto``: ``communication="auto"`` (probe, then its choice among flat, hier and int8).

Wire bytes: each host's local rank 0 reads its ``eth0`` tx counter (sysfs inside its namespace)
around every timed step, between barriers (one barrier's few hundred bytes per step are counted); the sum over both hosts is the inter-host traffic
(traffic between processes of one host stays on that host's loopback). Step time: per round,
the median over timed steps of rank 0's time; a variant's figure is the median over rounds of
its ratio to the baseline's median in the same round, with a 95% bootstrap interval.

SSP figure (benchmarks/ssp_straggler.py, on its own 3-host cluster): one parameter-server host and
2 worker hosts, the straggler host's link shaped to --rate (tbf, both directions), a 2 MiB linear
model, sync vs ssp:3 at the same lr and step budget, interleaved; time until both workers compute
with parameters at 0.1 x the initial loss; median ratio over rounds with a 95% interval.
Extras (loopback, one server, linear regression to 0.5% of the initial loss, sync vs ssp:4, a
worker held back by sleeping): ``persistent`` (worker 1 always computes 2x longer) and
``transient`` (each worker held back 6x on a random quarter of its steps). Under a persistent
compute straggler SSP cannot win in steady state: the bound holds the fast worker at the
straggler's clock + s and each worker pushes gradient / N, so progress per second is the
straggler's in both modes (what it still gains there is the push/pull round trip that sync
waits for and SSP overlaps). It pays where the straggler's *communication* is slow (the figure)
or its delays are transient.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the parts beside it, when loaded by path
from communication_figures import extra_figures, figures, print_table, summarize  # noqa: E402
from communication_job import LAYOUTS, RDZV_PORT, VARIANTS, job  # noqa: E402
from communication_ssp import ssp_part  # noqa: E402

HERE = Path(__file__).resolve()


# --- the driver: builds the cluster, launches, reads the results --------------------------------
def launch(cluster, nproc: int, rate: str | None, cfg: dict, tag: str) -> list[dict]:
    for host in cluster.hosts:
        host.shape(rate=rate) if rate else host.unshape()
    with tempfile.TemporaryDirectory() as out:
        job_cfg = {**cfg, "out": out}
        endpoint = f"{cluster.hosts[0].address}:{RDZV_PORT}"
        env = {"OMP_NUM_THREADS": "1", "TRAINMESH_TIMEOUT_S": "300"}
        procs = [
            host.popen(
                [
                    sys.executable,
                    "-m",
                    "trainmesh",
                    "run",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    str(nproc),
                    "--node-rank",
                    str(host.index),
                    "--rdzv-endpoint",
                    endpoint,
                    "--rdzv-id",
                    tag,
                    str(HERE),
                    "--job",
                    json.dumps(job_cfg),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for host in cluster.hosts
        ]
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=cfg["timeout"])[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append(proc.communicate()[0])
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{tag}: launcher failed:\n" + "\n".join(o[-3000:] for o in outputs))
        results = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2 * nproc)]
    for host in cluster.hosts:
        host.unshape()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)  # set by the driver: run as one process of the job
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--skip-ssp", action="store_true", help="leave out the parameter-server SSP part")
    parser.add_argument("--ssp-only", action="store_true", help="only the parameter-server SSP part")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {','.join(VARIANTS)} (figures need their variants)",
    )
    parser.add_argument(
        "--layouts",
        help=f"comma-separated subset of {','.join(LAYOUTS)} (default: all; the 2x2 one is left out with --quick)",
    )
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.job:
        job(json.loads(args.job))
        return 0
    from trainmesh.testing.cluster import Cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"needs the namespace cluster: {reason}")
        return 2
    if args.ssp_only:
        ssp = ssp_part(args.quick, args.rate)
        figs = {"ssp_time_to_loss_vs_sync_straggler_host": ssp["ratio"]}
        extra = {f"ssp_time_to_loss_vs_sync_{k}_straggler": ssp[k] for k in ("transient", "persistent") if k in ssp}
        for name, value in {**figs, **extra}.items():
            print(f"  {name} = {value:.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(
                    {"figures": figs, "extra": extra, "ssp": ssp, "valid": ssp["valid"], "load_avg": os.getloadavg()},
                    fh,
                    indent=1,
                    default=str,
                )
        if not ssp["valid"]:
            print("INVALID")
            return 1
        return 0
    variants = [v for v in args.variants.split(",") if v]
    layouts = [t for t in (args.layouts or "").split(",") if t] or [
        t for t in LAYOUTS if not (args.quick and t == "2x2_100mbit")
    ]
    unknown = [v for v in variants if v not in VARIANTS] + [t for t in layouts if t not in LAYOUTS]
    if unknown:
        parser.error(f"unknown variants or layouts: {unknown}")
    # Quick: 5 rounds of 2 steps, not fewer. Every variant shares 2 cores with the other 7
    # processes (and whatever else runs), and a median over 2 rounds is their mean: one disturbed
    # block moved auto-vs-flat, the same configuration, to 1.18 (0.83 and 1.53 in its 2 rounds).
    cfg = {
        "rounds": args.rounds or 5,
        "steps": args.steps or (2 if args.quick else 3),
        "warmup": args.warmup,
        "variants": variants,
        "timeout": 900,
    }
    summaries = {}
    with Cluster(2) as cluster:
        cluster.wait_reachable()
        for tag in layouts:
            nproc, rate = int(tag[2]), (None if tag.endswith("unshaped") else args.rate)
            summaries[tag] = summarize(launch(cluster, nproc, rate, cfg, tag), tag)
            print_table(summaries[tag])
    ssp = None
    if not args.skip_ssp:
        try:
            ssp = ssp_part(args.quick, args.rate)
        except Exception as error:  # noqa: BLE001 - the cluster figures above still stand; say so loudly
            print(f"SSP part failed, its figure is missing: {error!r:.500}")
    figs = figures(summaries.get("2x4_100mbit"), summaries.get("2x4_unshaped"), ssp)
    extra = extra_figures(summaries, ssp)
    print("\nfigures:")
    for name, value in figs.items():
        print(f"  {name} = {value:.3f}")
    print("extra (other baselines and layouts):")
    for name, value in extra.items():
        print(f"  {name} = {value:.3f}")
    valid = all(s["valid"] for s in summaries.values()) and (ssp is None or ssp["valid"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "figures": figs,
                    "extra": extra,
                    "runs": summaries,
                    "ssp": ssp,
                    "config": cfg,
                    "valid": valid,
                    "load_avg": os.getloadavg(),
                },
                fh,
                indent=1,
                default=str,
            )
    if not valid:
        print("INVALID")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
