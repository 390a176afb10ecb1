"""``ps_embedding_step_vs_torchrec``: one embedding step on the parameter servers against TorchRec.

A step is lookup + backward + update of 1,024 ids (512 per process, one id per bag) in a
1M x 64 fp32 table, on 2 gloo processes, SGD:

- PS: ``PSEmbedding`` (pull the distinct rows, look them up, backward, ``push_rows`` of their
  gradients, waited for) against 2 server processes of a ``LocalCluster`` started by rank 0, each
  holding half of the table's row ranges (so the PS side runs 4 processes, TorchRec 2);
- TorchRec: an ``EmbeddingBagCollection`` (sum pooling) sharded table-wise by
  ``DistributedModelParallel`` (one table: all of it on rank 0, looked up over all-to-alls), with
  SGD fused into the backward (``apply_optimizer_in_backward``).

Rounds are interleaved (the side that goes first alternates); each round times ``steps`` steps
of a side after a barrier, and the slower rank's time counts. The figure is the median over
rounds of PS step time / TorchRec step time (<= 1.0: the PS is as fast or faster).

TorchRec needs ``pip install torchrec`` and then ``pip install --no-deps fbgemm-gpu-cpu`` (after
``pip uninstall fbgemm-gpu``: the CUDA build its metadata pulls in shadows the CPU one). Where
it does not import, the part returns the reason and the figure is skipped by name.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

ROWS, DIM, IDS_PER_RANK = 1_000_000, 64, 512
FIGURE = "ps_embedding_step_vs_torchrec"


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
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    table = torchrec.EmbeddingBagConfig(
        name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["f"], pooling=torchrec.PoolingType.SUM
    )
    ebc = torchrec.EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.01})
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

    return step


def _ps_step(ids: torch.Tensor, client):
    from trainmesh.ps.embedding import PSEmbedding

    emb = PSEmbedding(ROWS, DIM, name="bench.emb", client=client, init_std=0.0, optimizer={"name": "sgd", "lr": 0.01})
    emb.register()

    def step() -> None:
        emb(ids).sum().backward()
        future = emb.push_gradients()
        if future is not None:
            future.result()  # updated on the servers, as TorchRec's fused step is

    return step


def _timed(step, steps: int) -> float:
    step()  # warm
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    own = torch.tensor([(time.perf_counter() - started) / steps])
    dist.all_reduce(own, op=dist.ReduceOp.MAX)  # the slower rank's step
    return float(own)


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
    try:
        sides = {"ps": _ps_step(ids, client), "torchrec": _torchrec_step(ids)}
        times: dict[str, list[float]] = {"ps": [], "torchrec": []}
        for r in range(rounds):
            for side in ("ps", "torchrec") if r % 2 == 0 else ("torchrec", "ps"):
                times[side].append(_timed(sides[side], steps))
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
    ratios = [p / t for p, t in zip(times["ps"], times["torchrec"])]
    import torchrec

    return {
        "ps_step_ms": 1e3 * statistics.median(times["ps"]),
        "torchrec_step_ms": 1e3 * statistics.median(times["torchrec"]),
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
    import os

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
        print(f"{'side':<10}{'median step ms':>16}\n{'PS':<10}{result['ps_step_ms']:>16.2f}")
        print(f"{'TorchRec':<10}{result['torchrec_step_ms']:>16.2f}")
        print(f"{FIGURE} {result[FIGURE]:.3f} (goal <= 1.0), load average {load:.1f}")
    if args.json:
        skipped = {FIGURE: result["skipped"]} if "skipped" in result else {}
        figures = {} if skipped else {FIGURE: result[FIGURE]}
        with open(args.json, "w") as fh:
            json.dump({"figures": figures, "figures_skipped": skipped, "detail": result, "load_average": load}, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
