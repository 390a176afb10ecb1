"""``ps_embedding_step_vs_torchrec``: one embedding step on the parameter servers against TorchRec.

A step is lookup + backward + update of 1,024 ids (512 per process, one id per bag) in a
1M x 64 fp32 table, on 2 gloo processes, SGD:

- PS: ``PSEmbedding`` (pull the distinct rows, look them up, backward, ``push_rows`` of their
  gradients, waited for) against 2 server processes of a ``LocalCluster`` started by rank 0, each
  holding half of the table's row ranges (so the PS side runs 4 processes, TorchRec 2);
- TorchRec: an ``EmbeddingBagCollection`` (sum pooling) sharded table-wise by
  ``DistributedModelParallel`` (one table: all of it on one rank, looked up over all-to-alls), with
  SGD fused into the backward (``apply_optimizer_in_backward``: FBGEMM's ``EXACT_SGD`` inside the
  table-batched embedding's backward, TorchRec's documented fastest optimizer path; no separate
  ``optimizer.step()``). TorchRec's default gradient division (the all-to-all's backward divides by
  the world size, to match DDP's averaging) is switched off, so both sides apply the same update:
  every touched row moves by exactly ``-lr`` x its summed gradient.

Equal work is checked, not assumed: before the timed rounds each side runs one step and the
touched rows' change is compared to ``-lr`` on both (``update_check`` in the JSON; the part fails
when they differ). Both sides use one intra-op thread per process, as the servers do.

Rounds are interleaved (the side that goes first alternates); each round times ``steps`` steps
of a side after a barrier, and the slower rank's time counts. The figure is the median over
rounds of PS step time / TorchRec step time (<= 1.0: the PS is as fast or faster).

CPU per step is measured beside it (not part of the figure): the CPU time of every process of a
side over its timed steps, divided by the steps. For the PS that is both workers plus both
servers (read from ``/proc/<pid>/stat``), for TorchRec both ranks. The servers' CPU during the
TorchRec rounds is recorded too (``ps_servers_idle_cpu_ms_per_step``): what idle servers take
from the other side.

TorchRec needs ``pip install torchrec`` and then ``pip install --no-deps fbgemm-gpu-cpu`` (after
``pip uninstall fbgemm-gpu``: the CUDA build its metadata pulls in shadows the CPU one). Where
it does not import, the part returns the reason and the figure is skipped by name.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

ROWS, DIM, IDS_PER_RANK, LR = 1_000_000, 64, 512, 0.01
FIGURE = "ps_embedding_step_vs_torchrec"
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def torchrec_unavailable() -> str | None:
    """None when TorchRec and its CPU kernels import, else the exact reason."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
        from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure is the reason to skip
        return f"torchrec not importable: {type(error).__name__}: {error}"
    return None


def _torchrec_step(ids: torch.Tensor):
    import logging
    import warnings

    # The planner warns about a hand-built Topology and its storage-reservation heuristic; neither
    # applies to one table on CPU, and the warnings would bury the benchmark's own table.
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torchrec")
    import torchrec
    from torchrec.distributed.comm_ops import set_gradient_division
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    table = torchrec.EmbeddingBagConfig(
        name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["f"], pooling=torchrec.PoolingType.SUM
    )
    # summed gradients, as the PS applies them (TorchRec divides by the world size by default)
    set_gradient_division(False)
    ebc = torchrec.EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": LR})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        constraints={"t": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value])},
    )
    group = dist.GroupMember.WORLD
    plan = planner.collective_plan(ebc, None, group)
    model = DistributedModelParallel(
        ebc, env=ShardingEnv.from_process_group(group), device=torch.device("cpu"), plan=plan
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=ids, lengths=torch.ones(ids.numel(), dtype=torch.int64)
    )

    def step() -> None:
        model(kjt).to_dict()["f"].sum().backward()  # the fused SGD updates the rows in backward

    def rows(all_ids: torch.Tensor) -> torch.Tensor | None:
        """The rows ``all_ids`` on the rank that holds the table (table-wise: one), else None."""
        shards = model.state_dict()["embedding_bags.t.weight"].local_shards()
        return shards[0].tensor[all_ids].clone() if shards else None

    return step, rows


def _ps_step(ids: torch.Tensor, client):
    from trainmesh.ps.embedding import PSEmbedding

    emb = PSEmbedding(ROWS, DIM, name="bench.emb", client=client, init_std=0.0, optimizer={"name": "sgd", "lr": LR})
    emb.register()

    def step() -> None:
        emb(ids).sum().backward()
        future = emb.push_gradients()
        if future is not None:
            future.result()  # updated on the servers, as TorchRec's fused step is

    def rows(all_ids: torch.Tensor) -> torch.Tensor | None:
        return client.pull_rows("bench.emb", all_ids).result() if dist.get_rank() == 0 else None

    return step, rows


def _servers_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the server processes (all their threads) so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total * _TICK_S


def _timed(step, steps: int, server_pids: list[int]) -> tuple[float, float, float]:
    """(step s of the slower rank, workers' CPU s per step summed over ranks, servers' CPU s per step)."""
    step()  # warm
    dist.barrier()
    servers = _servers_cpu_s(server_pids)
    cpu, started = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    dist.barrier()  # the servers have answered every rank's last push
    servers = _servers_cpu_s(server_pids) - servers
    slowest, workers = torch.tensor([wall / steps]), torch.tensor([cpu / steps, servers / steps])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slower rank's step
    dist.all_reduce(workers)  # every process's CPU (servers are read on rank 0 only)
    return float(slowest), float(workers[0]), float(workers[1])


def _check_update(sides: dict, ids: torch.Tensor) -> dict:
    """One step of each side; the touched rows must move by exactly -LR (each id once, sum loss)."""
    every = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
    dist.all_gather(every, ids)
    all_ids = torch.cat(every).sort().values
    checked = {}
    for side, (step, rows) in sides.items():
        before = rows(all_ids)
        step()
        dist.barrier()
        after = rows(all_ids)
        error = torch.tensor([float("nan") if before is None else float((after - before + LR).abs().max())])
        found = [torch.empty(1) for _ in range(dist.get_world_size())]
        dist.all_gather(found, error)
        checked[side] = min(float(e) for e in found if not torch.isnan(e))
    if max(checked.values()) > 1e-6:
        raise AssertionError(f"the two sides do not apply the same update (max |change + lr| per side): {checked}")
    return checked


def embedding_worker(rounds: int, steps: int) -> dict:
    from trainmesh.ps.client import PSClient
    from trainmesh.ps.cluster import LocalCluster

    torch.set_num_threads(1)
    rank = dist.get_rank()
    ids = torch.randperm(ROWS, generator=torch.Generator().manual_seed(11))[
        rank * IDS_PER_RANK : (rank + 1) * IDS_PER_RANK
    ]
    cluster = LocalCluster(2, num_workers=dist.get_world_size()) if rank == 0 else None
    where = [(cluster.addresses, cluster.secret) if cluster else None]
    dist.broadcast_object_list(where, src=0)
    addresses, secret = where[0]
    client = PSClient(servers=addresses, worker_id=rank, num_workers=dist.get_world_size(), secret=secret)
    server_pids = [p.pid for p in cluster.processes] if cluster is not None else []
    try:
        sides = {"ps": _ps_step(ids, client), "torchrec": _torchrec_step(ids)}
        times: dict = {"update_check": _check_update(sides, ids)}
        for r in range(rounds):
            for side in ("ps", "torchrec") if r % 2 == 0 else ("torchrec", "ps"):
                for key, value in zip(
                    ("step", "workers_cpu", "servers_cpu"), _timed(sides[side][0], steps, server_pids)
                ):
                    times.setdefault(f"{side}_{key}", []).append(value)
        dist.barrier()
    finally:
        client.close()
        dist.barrier()
        if cluster is not None:
            cluster.stop()
    return times


def embedding_part(rounds: int, steps: int) -> dict:
    reason = torchrec_unavailable()
    if reason is not None:
        return {"skipped": reason}
    from trainmesh.testing import run_distributed

    times = run_distributed(embedding_worker, 2, args=(rounds, steps), timeout=900)[0]
    ratios = [p / t for p, t in zip(times["ps_step"], times["torchrec_step"])]
    import torchrec

    def ms(key: str) -> float:
        return 1e3 * statistics.median(times[key])

    return {
        "ps_step_ms": ms("ps_step"),
        "torchrec_step_ms": ms("torchrec_step"),
        "ps_cpu_ms_per_step": 1e3 * (sum(times["ps_workers_cpu"]) + sum(times["ps_servers_cpu"])) / rounds,
        "ps_workers_cpu_ms_per_step": 1e3 * sum(times["ps_workers_cpu"]) / rounds,
        "ps_servers_cpu_ms_per_step": 1e3 * sum(times["ps_servers_cpu"]) / rounds,
        "torchrec_cpu_ms_per_step": 1e3 * sum(times["torchrec_workers_cpu"]) / rounds,
        "ps_servers_idle_cpu_ms_per_step": 1e3 * sum(times["torchrec_servers_cpu"]) / rounds,
        "ps_step_ms_rounds": [1e3 * t for t in times["ps_step"]],
        "torchrec_step_ms_rounds": [1e3 * t for t in times["torchrec_step"]],
        "update_check": times["update_check"],
        "ratios": ratios,
        FIGURE: statistics.median(ratios),
        "rounds": rounds,
        "steps": steps,
        "torchrec": torchrec.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    """This part alone (``ps.py --parts embedding`` runs the same inside the PS benchmark)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per side (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side per round (default 20)")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 10 steps")
    parser.add_argument("--json", metavar="PATH", help="write the figures and the detail here")
    args = parser.parse_args(argv)
    rounds, steps = (3, 10) if args.quick else (args.rounds, args.steps)
    result = embedding_part(rounds, steps)
    load = os.getloadavg()[0]
    if "skipped" in result:
        print(f"{FIGURE}: skipped ({result['skipped']})")
    else:
        print(f"{'side':<10}{'median step ms':>16}{'CPU ms / step':>16}")
        print(f"{'PS':<10}{result['ps_step_ms']:>16.2f}{result['ps_cpu_ms_per_step']:>16.2f}")
        print(f"{'TorchRec':<10}{result['torchrec_step_ms']:>16.2f}{result['torchrec_cpu_ms_per_step']:>16.2f}")
        print(
            f"PS CPU: workers {result['ps_workers_cpu_ms_per_step']:.2f} + servers "
            f"{result['ps_servers_cpu_ms_per_step']:.2f} ms/step (servers idle in TorchRec rounds: "
            f"{result['ps_servers_idle_cpu_ms_per_step']:.2f}); ratios {[round(r, 3) for r in result['ratios']]}"
        )
        print(f"{FIGURE} {result[FIGURE]:.3f} (goal <= 1.0), load average {load:.1f}")
    if args.json:
        skipped = {FIGURE: result["skipped"]} if "skipped" in result else {}
        figures = {} if skipped else {FIGURE: result[FIGURE]}
        with open(args.json, "w") as fh:
            json.dump({"figures": figures, "figures_skipped": skipped, "detail": result, "load_average": load}, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
