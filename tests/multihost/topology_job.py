"""A job for test_topology.py (run through `trainmesh run` in each of 2 namespace hosts).

Every process records the hosts it discovered (no TRAINMESH_HOST_ID: host name + gloo interface
address), then trains the same model under flat fp32, the default (hierarchical across the
discovered hosts) fp32, and int8 (two-phase across hosts), each for STEPS steps; local rank 0 of
each host reads its eth0 tx counter around each run. The byte counter's wire figures are kept too.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

import trainmesh as tm
from trainmesh.comm.topology import discover
from trainmesh.trainer.communication import install_communication
from trainmesh.trainer.config import TrainerConfig

STEPS, IN, HIDDEN = 4, 64, 384  # ~175k parameters: the gradients dwarf the control traffic


def tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as fh:
        return int(fh.read())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cluster = tm.initialize()
    torch.set_num_threads(1)
    local_rank = int(os.environ["LOCAL_RANK"])
    out = {"hosts": [list(h) for h in discover().hosts], "host_ids": list(discover().host_ids)}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, IN, generator=g), torch.randn(64, 1, generator=g)
    shard = slice(cluster.rank * 16, cluster.rank * 16 + 16)
    for name, options in (
        ("flat", {"hierarchical_allreduce": False}),
        ("default", {}),
        ("int8", {"compression": "int8"}),
    ):
        torch.manual_seed(0)
        model = tm.DataParallel().distribute_model(
            torch.nn.Sequential(
                torch.nn.Linear(IN, HIDDEN),
                torch.nn.Tanh(),
                torch.nn.Linear(HIDDEN, HIDDEN),
                torch.nn.Tanh(),
                torch.nn.Linear(HIDDEN, 1),
            )
        )
        comm = install_communication(model, TrainerConfig(**options))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        dist.barrier()
        before = tx_bytes()
        wire = 0
        for _ in range(STEPS):
            torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
            optimizer.step()
            optimizer.zero_grad()
            wire += comm.step_record().get("comm_wire_bytes", 0)
        dist.barrier()
        out[name] = {
            "tx": tx_bytes() - before if local_rank == 0 else 0,
            "wire": wire,
            "hierarchical": comm.hierarchical,
            "params": sum(p.numel() for p in model.parameters()),
            "checksum": float(sum(p.double().sum() for p in model.parameters())),
        }
    with open(os.path.join(args.out, f"rank{cluster.rank}.json"), "w") as fh:
        json.dump(out, fh)
    tm.shutdown()


if __name__ == "__main__":
    main()
