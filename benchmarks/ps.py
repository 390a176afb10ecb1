"""Parameter-server benchmark: transport efficiency, compression, and stragglers.

    python benchmarks/ps.py [--rounds R] [--repeats N] [--window W] [--json PATH] [--quick] [--parts transport,...]

Part 1 (one client process, 2 local server processes): dense push throughput and pull latency
p50/p99 for 1 MB and 16 MB tensors, and for sparse rows (1024 rows x 64 of a 1M-row table),
interleaved round by round with raw ZeroMQ for the same message size and count, measured two
ways: ``trainmesh.ps.loopback_bandwidth`` (client and echo server are threads of this
process; moves the bytes, applies nothing: context only) and a plain pyzmq DEALER -> ROUTER echo
in a separate process (the shape of a push: payload out, a 3-byte ack back, across processes),
which applies what it receives as a PS server's plain-SGD step does: a dense gradient with
``add_`` to a value of its size, sparse ids and rows (two frames) with ``index_add_`` to its own
1M x 64 table (on one process, where the PS splits the rows over two servers). Every side sends
its messages with up to W in flight (pipelined equally; and again one at a time) and waits for
one ack per message. The ratio divides by the process echo, the side that does the same work
(``push_to_faster_raw`` keeps the older ratio to the faster of the two raw sides, for dense
usually the thread, which crosses no process boundary). Target: 1 MB push throughput >= 50% of raw.
Same work: every side must see an ack for each of its messages, and the servers' values after the
run must equal -(pushes applied) x gradient exactly (lr 1, integer gradients); otherwise the
run prints INVALID and exits 1.
Part 2: bytes on the wire for one 16 MB push without compression and with fp16, int8, topk:0.01.
Part 4 (benchmarks/ps_embedding.py): ps_embedding_step_vs_torchrec, an embedding step (lookup +
backward + update of 1,024 ids in a 1M x 64 table, 2 processes) on PSEmbedding against TorchRec's
table-wise sharded EmbeddingBagCollection; skipped, with the reason, where TorchRec does not import.
Part 3 (2 gloo worker processes): time until a linear-regression model reaches a target loss
under ParameterServerStrategy sync / async / ssp:2 and under torch DDP all-reduce (gloo), with
worker 1 a 2x straggler (every step sleeps COMPUTE_S, worker 1 twice that: simulated compute).
Targets: async and SSP reach the target sooner than sync and than all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from trainmesh.ps.client import PSClient
from trainmesh.ps.cluster import LocalCluster

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ps_embedding import FIGURE as EMBEDDING_FIGURE  # noqa: E402
from ps_embedding import embedding_part  # noqa: E402
from ps_straggler import COMPUTE_S, DIM, LR, TARGET_FRACTION, straggler_part  # noqa: E402
from ps_transport import DENSE_SIZES, MB, transport_part  # noqa: E402

COMPRESSIONS = (None, "fp16", "int8", "topk:0.01")
PUSH_TARGET = 0.5


# --- part 2: compression ------------------------------------------------------------------------------
def compression_part() -> dict:
    out = {}
    grad = torch.randn(16 * MB // 4)
    with LocalCluster(1, num_workers=1) as cluster:
        for spec in COMPRESSIONS:
            with PSClient(
                servers=cluster.addresses, worker_id=0, num_workers=1, compression=spec, secret=cluster.secret
            ) as client:
                name = f"w-{spec}"
                client.init(
                    [
                        {
                            "name": name,
                            "kind": "dense",
                            "value": torch.zeros_like(grad),
                            "optimizer": {"name": "sgd", "lr": 1.0},
                        }
                    ]
                )
                before = client.bytes_sent
                client.push({name: grad}).result()
                sent = client.bytes_sent - before
                applied = -client.pull([name]).result()[name]
                error = float((applied - grad).norm() / grad.norm())
            out[spec or "none"] = {"bytes": sent, "relative_error": error}
    for m in out.values():
        m["ratio_to_none"] = m["bytes"] / out["none"]["bytes"]
    return out


# --- reporting --------------------------------------------------------------------------------------------
def report(transport: dict, compression: dict, straggler: dict) -> dict:
    if transport:
        w = transport["window"]
        print(
            f"\nEach side moves the same messages ({transport['repeats']} per round and size, {transport['rounds']} "
            f"interleaved rounds, one warm-up message first), each acknowledged by the receiver, "
            f"with up to {w} in flight (and, second table column, one at a time):\n"
            f"  PS push: client.push({{name: fp32 tensor}}) to 2 server processes; acked after the server applied "
            f"it (SGD); tensors leave from their own memory (multipart, copy=False)\n"
            f"  raw ZeroMQ, thread: DEALER send(bytes, copy=False) to a ROUTER in a thread of this process, 3-byte ack\n"
            f"  raw ZeroMQ, process: the same to a ROUTER echo in another process (the PS's shape), which applies it\n"
            f"    as SGD does (dense: add_ to a value; sparse: ids + rows as two frames, index_add_ to a 1M x 64 table)\n"
            f"  push/zmq: push throughput / the process echo's, per round; median [95% range]"
            f" (old ratio to the faster raw side: 'vs faster')"
        )
        print(
            f"\n{'tensor':<8} {'pushes/s':>9} {'push MB/s':>10} {'zmq MB/s (thread/process)':>26} "
            f"{f'push/zmq w={w}':>20} {'push/zmq w=1':>20} {'vs faster':>10} {'pull p50 ms':>12} {'pull p99 ms':>12}"
        )
        for label, m in transport["sizes"].items():
            raw = f"{m['loopback_MBps']:.0f} / {m['process_loopback_MBps']:.0f}"

            def ratio(sfx):
                return (
                    f"{m['push_to_loopback' + sfx]:.2f} [{m['push_to_loopback_ci95' + sfx][0]:.2f}-"  # noqa: E731
                    f"{m['push_to_loopback_ci95' + sfx][1]:.2f}]"
                )

            print(
                f"{label:<8} {m['push_per_s']:>9.1f} {m['push_MBps']:>10.0f} {raw:>26} {ratio(''):>20} "
                f"{ratio('_w1'):>20} {m['push_to_faster_raw']:>10.2f} {m['pull_p50_ms']:>12.2f} {m['pull_p99_ms']:>12.2f}"
            )
        print(
            f"same work: {'yes' if transport['same_work'] else 'NO'} (messages acknowledged on every side; "
            f"server values == -pushes x gradient exactly, pushes applied {transport['pushes_applied']})"
        )
    print(f"\n{'compression':<12} {'bytes sent':>12} {'vs none':>8} {'rel. error':>11}")
    for spec, m in compression.items():
        print(f"{spec:<12} {m['bytes']:>12,} {m['ratio_to_none']:>8.3f} {m['relative_error']:>11.4f}")
    print(f"\n{'straggler 2x':<14} {'s to target':>11} {'vs all-reduce':>14} {'worker-0 steps':>15}")
    for variant, m in straggler.items():
        shown = f"{m['seconds']:.2f}" if m["seconds"] else "not reached"
        ratio = f"{m['ratio_to_allreduce']:.2f}" if m["ratio_to_allreduce"] else "-"
        print(f"{variant:<14} {shown:>11} {ratio:>14} {m['steps_worker0']:>15.0f}")
    verdict = {}
    if transport:
        verdict["dense_push_target_met"] = all(
            transport["sizes"][label]["push_to_loopback"] >= PUSH_TARGET for label in DENSE_SIZES
        )
        print(
            f"\ndense push >= {PUSH_TARGET:.0%} of raw ZeroMQ loopback ({transport['window']} in flight): "
            f"{'met' if verdict['dense_push_target_met'] else 'NOT met'}"
        )
    if straggler:
        sec = {v: straggler[v]["seconds"] or float("inf") for v in straggler}
        verdict["straggler_target_met"] = all(
            sec[v] < min(sec["ps-sync"], sec["ddp-allreduce"]) for v in ("ps-async", "ps-ssp:2")
        )
        print(
            f"async and SSP reach the target before sync and all-reduce: "
            f"{'met' if verdict['straggler_target_met'] else 'NOT met'}"
        )
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # A full run measures more than --quick's 3 rounds of 40 messages: per-round ratios of one commit
    # spread 0.39-0.65 for the 1 MB push, so 10 rounds of 200 (about 80 s for part 1).
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds of every measurement")
    parser.add_argument("--repeats", type=int, default=200, help="pushes and pulls per round and size")
    parser.add_argument(
        "--window",
        type=int,
        default=4,
        help="pushes (and raw ZeroMQ messages) in flight before waiting for the oldest ack",
    )
    parser.add_argument("--straggler-rounds", type=int, default=2)
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 rounds of 40 messages, one straggler round")
    parser.add_argument(
        "--parts",
        default="transport,compression,straggler,embedding",
        help="comma-separated parts to run (default: all four; embedding is the step against TorchRec)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        # The transport part stays at 3 rounds (its figure is a median over rounds) of 40 messages a
        # side: at 8, filling and draining the window of 4 was half of each measurement, which
        # times latency rather than throughput (quick runs of one commit read 0.36-0.42, 0.43-0.47
        # at 150 messages).
        args.rounds, args.repeats, args.straggler_rounds = 3, 40, 1
    if args.window < 1 or args.rounds < 1 or args.repeats < 1:
        parser.error(f"--window, --rounds and --repeats must be >= 1, got {args.window}, {args.rounds}, {args.repeats}")
    torch.set_num_threads(1)
    started = time.perf_counter()
    parts = set(args.parts.split(","))
    if not parts or parts - {"transport", "compression", "straggler", "embedding"}:
        parser.error(f"--parts must list transport, compression, straggler and/or embedding, got {args.parts!r}")
    transport = transport_part(args.rounds, args.repeats, args.window) if "transport" in parts else {}
    compression = compression_part() if "compression" in parts else {}
    straggler = straggler_part(args.straggler_rounds) if "straggler" in parts else {}
    # interleaved rounds of PS and TorchRec embedding steps (see ps_embedding.py)
    embedding = (
        embedding_part(*((3, 10) if args.quick else (5, 20)))
        if "embedding" in parts
        else {"skipped": "not selected by --parts"}
    )
    verdict = report(transport, compression, straggler)
    if "skipped" in embedding:
        print(f"\n{EMBEDDING_FIGURE}: skipped ({embedding['skipped']})")
    else:
        print(
            f"\nembedding step (1,024 ids, 1M x 64, 2 processes): PS {embedding['ps_step_ms']:.2f} ms, TorchRec "
            f"{embedding['torchrec_step_ms']:.2f} ms, {EMBEDDING_FIGURE} {embedding[EMBEDDING_FIGURE]:.2f} (goal <= 1.0)"
        )
    print(f"({time.perf_counter() - started:.0f}s, load average {os.getloadavg()[0]:.1f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "transport": transport,
                    "embedding": embedding,
                    "compression": compression,
                    "straggler": straggler,
                    **verdict,
                    "config": {
                        **vars(args),
                        "compute_s": COMPUTE_S,
                        "lr": LR,
                        "target_fraction": TARGET_FRACTION,
                        "dim": DIM,
                    },
                    "torch": torch.__version__,
                    "load_average": os.getloadavg(),
                    # push throughput / raw ZeroMQ loopback for the same 1 MB messages, both with
                    # --window in flight (higher is better); the same for a push of 1024 random rows
                    # of a 1M-row table (context, no target)
                    "figures": {
                        **(
                            {
                                "ps_push_1mb_vs_raw_zmq": transport["sizes"]["1 MB"]["push_to_loopback"],
                                "ps_sparse_push_vs_raw_zmq": transport["sizes"]["sparse"]["push_to_loopback"],
                            }
                            if transport
                            else {}
                        ),
                        # PS step time / TorchRec's (lower is better; goal <= 1.0)
                        **({} if "skipped" in embedding else {EMBEDDING_FIGURE: embedding[EMBEDDING_FIGURE]}),
                    },
                    "figures_skipped": {EMBEDDING_FIGURE: embedding["skipped"]} if "skipped" in embedding else {},
                },
                fh,
                indent=1,
            )
    if transport and not transport["same_work"]:
        print(
            f"INVALID: the PS and raw ZeroMQ sides did not do the same work: {transport['problems']}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
