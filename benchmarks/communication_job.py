"""communication.py's job, run in every process of the 2-host cluster (``communication.py --job CFG``):
the variants (flat, hierarchical, compressed, auto) and their trainmesh options, the model and data, and
one variant's timed steps with the bytes each host sent, written as JSON.

It exists apart from the script because it runs inside the measured processes, the script outside them.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
from torch import nn


VARIANTS = ("flat", "hier", "int8", "topk1", "powersgd", "auto")
OPTIONS = {
    "flat": {"hierarchical_allreduce": False},
    "hier": {"hierarchical_allreduce": True},
    "int8": {"compression": "int8"},
    "topk1": {"compression": "topk:0.01"},
    "powersgd": {"compression": "powersgd:2"},
    "auto": {"communication": "auto"},
}
AUTO_CANDIDATES = ("flat", "hier", "int8")  # what auto chooses among: its "best fixed choice"
IN_DIM, HIDDEN, OUT_DIM, BATCH, LR = 256, 1024, 256, 64, 0.05
RDZV_PORT = 29511
LAYOUTS = ("2x4_100mbit", "2x4_unshaped", "2x2_100mbit")  # hosts x processes per host, inter-host link


# --- the job: runs in every process of the 2-host cluster ----------------------------------------
def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT_DIM)
    )


def make_data(batches: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batches * BATCH, IN_DIM, generator=g)
    teacher = torch.randn(IN_DIM, OUT_DIM, generator=g) / IN_DIM**0.5
    return x, torch.tanh(x @ teacher) + 0.1 * torch.randn(x.shape[0], OUT_DIM, generator=g)


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as fh:
        return int(fh.read())


def job(cfg: dict) -> None:
    import torch.distributed as dist

    import trainmesh as tm
    from trainmesh.trainer.communication import install_communication
    from trainmesh.trainer.config import TrainerConfig

    cluster = tm.initialize()
    torch.set_num_threads(1)
    rank, world = cluster.rank, cluster.world_size
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    num_batches = 8
    x, y = make_data(num_batches)
    local = BATCH // world
    sides, printed = {}, {}
    for name in cfg["variants"]:
        model = tm.DataParallel().distribute_model(build_model())
        comm = install_communication(model, TrainerConfig(**OPTIONS[name]))
        printed[name] = comm.describe()
        sides[name] = {
            "model": model,
            "opt": torch.optim.SGD(model.parameters(), lr=LR),
            "step": 0,
            "comm": comm,
            "tx": 0,
            "timed": 0,
            "cpu": 0.0,
        }

    def step(side) -> None:
        start = (side["step"] % num_batches) * BATCH + rank * local
        side["step"] += 1
        loss = nn.functional.mse_loss(side["model"](x[start : start + local]), y[start : start + local])
        loss.backward()
        side["opt"].step()
        side["opt"].zero_grad()
        side["comm"].step_record()

    times = {name: [] for name in cfg["variants"]}
    for r in range(cfg["rounds"]):
        shift = r % len(cfg["variants"])
        order = cfg["variants"][shift:] + cfg["variants"][:shift]
        # Timed steps interleaved one by one (not in blocks per variant): the load of other work on
        # the machine changes within seconds, and adjacent steps of two variants see the same load.
        # Each timed step right after W untimed ones of the same variant: the first step on a process
        # group's connections after other groups' steps pays for the idle connections (TCP restarts
        # slow start after idle), so a variant's time depended on which one ran before it: without
        # these, flat and auto (the same configuration) differed by 7-25% in every round, in the
        # direction the order gave.
        block = {name: [] for name in order}
        for k in range(cfg["steps"]):
            for name in order[k % len(order) :] + order[: k % len(order)]:
                side = sides[name]
                for _ in range(cfg["warmup"]):
                    step(side)
                dist.barrier()
                tx0 = _tx_bytes() if local_rank == 0 else 0
                cpu0, t0 = time.process_time(), time.perf_counter()
                step(side)
                block[name].append(time.perf_counter() - t0)
                side["cpu"] += time.process_time() - cpu0
                dist.barrier()  # every rank's traffic of this step is through before the counter is read
                if local_rank == 0:
                    side["tx"] += _tx_bytes() - tx0
                side["timed"] += 1
        for name in order:
            times[name].append(statistics.median(block[name]))
    # CPU seconds per timed step summed over every process (all threads): on a shared 2-core
    # machine the step is often CPU-bound, and this says how much of it each variant's work is.
    cpu = torch.tensor([sides[n]["cpu"] / max(1, sides[n]["timed"]) for n in cfg["variants"]], dtype=torch.float64)
    dist.all_reduce(cpu)
    result = {
        "times": times,
        "printed": printed,
        "cpu_s_per_step": dict(zip(cfg["variants"], cpu.tolist())),
        "steps": {n: s["step"] for n, s in sides.items()},
        "tx": {n: s["tx"] for n, s in sides.items()},
        "timed": {n: s["timed"] for n, s in sides.items()},
    }
    with torch.no_grad():
        result["final_loss"] = {n: nn.functional.mse_loss(s["model"].module(x), y).item() for n, s in sides.items()}
        result["checksum"] = {
            n: float(sum(p.double().sum() for p in s["model"].parameters())) for n, s in sides.items()
        }
    result["plan"] = (
        getattr(sides.get("auto", {}).get("comm"), "plan", None).__dict__
        if "auto" in sides and sides["auto"]["comm"].plan is not None
        else None
    )
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    tm.shutdown()
