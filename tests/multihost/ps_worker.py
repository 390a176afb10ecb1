"""A parameter-server worker for the cross-host test (run in a network-namespace host).

``push``: init ``w`` (the first init wins), push ``--pushes`` seeded gradients of which the first
half are waited for (acknowledged), then send the rest without waiting, write
``inflight.<worker>`` (the test kills the server host now), and wait for every acknowledgement.
``check``: print the servers' ``w`` and statistics as JSON; with ``--intruder-secret`` also how
a client signing with that (wrong) secret fared, and the statistics and ``w`` after it tried.
"""

import argparse
import json
import os

import torch

from trainmesh.ps.client import PSClient
from trainmesh.ps.errors import PSAuthError, PSTimeoutError

SGD = {"name": "sgd", "lr": 0.1}
NUMEL = 64  # 8 parts of 8 over the servers


def grads(worker: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + worker)
    return [torch.randn(NUMEL, generator=generator) for _ in range(count)]


def initial() -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))


def intrude(servers: list[str], secret: str) -> str:
    """How a client signing with ``secret`` fares (the client registers as it is built)."""
    try:
        client = PSClient(servers=servers, worker_id="intruder", part_numel=8, secret=secret, request_timeout_s=4)
        client.init({"w": torch.zeros(NUMEL)}, optimizer=SGD).result(30)
        client.close()
        return "accepted"
    except PSAuthError:
        return "refused"
    except PSTimeoutError:
        return "timed out"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["push", "check"])
    parser.add_argument("--servers", required=True)
    parser.add_argument("--worker", type=int, default=0)
    parser.add_argument("--pushes", type=int, default=40)
    parser.add_argument("--out", default=".")
    parser.add_argument("--intruder-secret", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    secret = os.environ["TRAINMESH_PS_SECRET"]
    servers = args.servers.split(",")
    client = PSClient(
        servers=servers,
        worker_id=args.worker if args.mode == "push" else "checker",
        part_numel=8,
        secret=secret,
        retry_after_s=0.5,
        request_timeout_s=120,
    )
    client.init({"w": initial()}, optimizer=SGD).result(60)
    if args.mode == "check":
        report = {"w": client.pull(["w"]).result(60)["w"].tolist(), "servers": client.stats().result(60)["servers"]}
        if args.intruder_secret:
            report["intruder"] = intrude(servers, args.intruder_secret)
            report["servers_after"] = client.stats().result(60)["servers"]
            report["w_after"] = client.pull(["w"]).result(60)["w"].tolist()
        print(json.dumps(report))
        client.close()
        return
    mine = grads(args.worker, args.pushes)
    half = len(mine) // 2
    for g in mine[:half]:
        client.push({"w": g}).result(120)
    in_flight = [client.push({"w": g}) for g in mine[half:]]
    with open(os.path.join(args.out, f"inflight.{args.worker}"), "w") as fh:
        fh.write(str(sum(not f.done() for f in in_flight)))
    for future in in_flight:
        future.result(120)  # resent with the same sequence numbers until the restarted server acks
    stats = client.stats().result(60)
    with open(os.path.join(args.out, f"done.{args.worker}"), "w") as fh:
        json.dump({"resends": stats["resends"]}, fh)
    client.close()


if __name__ == "__main__":
    main()
