"""How long does a checkpoint hold training? trainmesh sync / async sharded save vs ``torch.save``.

    python benchmarks/checkpoint.py [--nproc 2] [--rounds 3] [--layers 12] [--width 2048]
                                    [--dir DIR] [--json PATH]

State: an MLP of ``layers`` Linear(width, width) (default 12 x 2048^2 = 50.4M parameters) under
DDP (zero stage 0) with Adam after one step: 201 MB of parameters + 403 MB of Adam moments.
Every round runs the three savers back to back, rotating which goes first (interleaved):

* ``torch.save``: the baseline a plain PyTorch script uses: gather the full model + optimizer
  state dicts (``get_model_state_dict`` / ``get_optimizer_state_dict``, full, CPU) on rank 0
  and ``torch.save`` them to one file, then a barrier.
* ``sync``: ``CheckpointManager.save`` (DCP, each rank writes its shards; for DDP's replicated
  tensors DCP splits the writing between ranks), checksums, marker, rename.
* ``async``: ``CheckpointManager(async_save=True).save``: blocks while the state is staged to a
  CPU copy, then returns; ``blocking`` is that time. One simulated training step of compute
  (a matmul loop) runs next, then ``close()`` commits; ``total`` is save() to commit.

Times are the slowest rank's, per round; the table gives median and min-max. MB/s is bytes on
disk / time. Target (issue 5): async blocking <= 10% of the sync save time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch


def _dir_bytes(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _worker(root, rounds, layers, width):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    import trainmesh as tm
    from trainmesh.checkpoint import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model = tm.DataParallel().distribute_model(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "trainer": {"global_step": 1}}
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    rank = tm.rank()
    work = torch.randn(1024, 1024)

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def run_torch_save(r):
        path = os.path.join(root, f"torch_{r}.pt")
        dist.barrier()
        t0 = time.perf_counter()
        msd = get_model_state_dict(model, options=full)
        osd = get_optimizer_state_dict(model, opt, options=full)
        if rank == 0:
            torch.save({"model": msd, "optimizer": osd}, path)
        dist.barrier()
        took = slowest(time.perf_counter() - t0)
        size = _dir_bytes(path) if rank == 0 else 0
        return {"save": took, "bytes": size}, path

    # One manager per saver for the whole run, as in training (the async one keeps its staging
    # buffers between saves); keep_last=1 deletes the previous round's checkpoint.
    managers = {
        flag: CheckpointManager(os.path.join(root, "async" if flag else "sync"), keep_last=1, async_save=flag)
        for flag in (False, True)
    }

    def run_manager(r, use_async):
        manager = managers[use_async]
        path = os.path.join(manager.directory, f"step_{r + 1:08d}")
        dist.barrier()
        t0 = time.perf_counter()
        manager.save(r + 1, state)
        blocking = time.perf_counter() - t0
        if use_async:
            for _ in range(20):  # the training step that overlaps the background write
                work @ work
            manager.close()
        total = time.perf_counter() - t0
        out = {"blocking": slowest(blocking), "save": slowest(total), "bytes": _dir_bytes(path) if rank == 0 else 0}
        return out, None

    runners = {
        "torch.save": run_torch_save,
        "sync": lambda r: run_manager(r, False),
        "async": lambda r: run_manager(r, True),
    }
    order = list(runners)
    results = {name: [] for name in order}
    for name in order:  # warm-up, untimed: first-save allocations (staging buffers, file cache)
        runners[name](-1)
    for r in range(rounds):
        for name in order[r % 3 :] + order[: r % 3]:
            measured, path = runners[name](r)
            results[name].append(measured)
            dist.barrier()
            if rank == 0 and path:
                os.remove(path)
            dist.barrier()
    params = sum(p.numel() for p in model.parameters())
    return {
        "results": results,
        "params": params,
        "same_work": _restores_equal(model, opt, managers, root, layers, width, full),
    }


def _restores_equal(model, opt, managers, root, layers, width, full) -> dict:
    """Did every saver write the same state? Each checkpoint is read back into a fresh model and
    optimizer (other values) and compared exactly with the state the savers were given."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    import trainmesh as tm

    want = {
        "model": get_model_state_dict(model, options=full),
        "optimizer": get_optimizer_state_dict(model, opt, options=full),
    }

    def fresh():
        torch.manual_seed(1)
        other = tm.DataParallel().distribute_model(
            torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        )
        other_opt = torch.optim.Adam(other.parameters(), lr=1e-4)
        other(torch.randn(4, width)).sum().backward()
        other_opt.step()
        return other, other_opt

    def equal(a, b) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    verdict = {}
    for use_async, manager in managers.items():
        other, other_opt = fresh()
        manager.load(None, {"model": other, "optimizer": other_opt, "trainer": {}})
        got = {
            "model": get_model_state_dict(other, options=full),
            "optimizer": get_optimizer_state_dict(other, other_opt, options=full),
        }
        verdict["async" if use_async else "sync"] = equal(want, got)
    path = os.path.join(root, "torch_check.pt")
    if tm.rank() == 0:
        torch.save(want, path)
        verdict["torch.save"] = equal(want, torch.load(path, weights_only=False))
        os.remove(path)
    dist.barrier()
    return verdict


def _summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a smaller model (4 x 1024), 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.layers, args.width = 2, 4, 1024
    from trainmesh.testing import run_distributed

    root = args.dir or tempfile.mkdtemp(prefix="trainmesh-ckpt-bench-")
    os.makedirs(root, exist_ok=True)
    try:
        out = run_distributed(
            _worker,
            world_size=args.nproc,
            args=(root, args.rounds, args.layers, args.width),
            timeout=3600,
            collective_timeout=1800,
        )[0]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    res = out["results"]
    rows = {}
    for name, runs in res.items():
        save = _summary([m["save"] for m in runs])
        row = {"save_s": save, "bytes": runs[0]["bytes"], "MB_per_s": runs[0]["bytes"] / 1e6 / save["median"]}
        row["blocking_s"] = _summary([m.get("blocking", m["save"]) for m in runs])
        rows[name] = row
    sync_med = rows["sync"]["save_s"]["median"]
    ratio = rows["async"]["blocking_s"]["median"] / sync_med
    print(
        f"{out['params'] / 1e6:.1f}M parameters + Adam, {args.nproc} processes, {args.rounds} interleaved rounds "
        f"(slowest rank; median [min-max])"
    )
    print(f"{'saver':<11}{'blocks training s':>26}{'total s':>26}{'MB on disk':>12}{'MB/s':>9}")
    for name, row in rows.items():
        b, s = row["blocking_s"], row["save_s"]
        print(
            f"{name:<11}{b['median']:>9.3f} [{b['min']:.3f}-{b['max']:.3f}]{'':>2}"
            f"{s['median']:>9.3f} [{s['min']:.3f}-{s['max']:.3f}]{'':>2}{row['bytes'] / 1e6:>10.0f}{row['MB_per_s']:>9.0f}"
        )
    print(
        f"async blocking / sync save = {ratio:.3f} (target <= 0.10: {'met' if ratio <= 0.10 else 'NOT met'}); "
        f"sync / torch.save = {sync_med / rows['torch.save']['save_s']['median']:.2f}"
    )
    same = out["same_work"]
    valid = bool(same) and all(same.values())
    print(f"same state written by every saver (read back, compared exactly): {same}")
    if not valid:
        print("INVALID: the savers did not write the same state", file=sys.stderr)
    report = {
        "valid": valid,
        "same_work": same,
        "params": out["params"],
        "nproc": args.nproc,
        "rounds": args.rounds,
        "savers": rows,
        "async_blocking_over_sync": ratio,
        "raw": res,
        "torch": torch.__version__,
        "quick": args.quick,
        "figures": {"async_ckpt_block_vs_sync": ratio},
        "loadavg": os.getloadavg(),
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["valid"] else 1)
