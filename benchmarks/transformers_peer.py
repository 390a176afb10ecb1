"""transformers as a peer: one training step under trainmesh and under transformers' own distributed training.

    python benchmarks/transformers_peer.py [--quick | --smoke] [--nproc 2,4] [--rounds R] [--steps S] [--json PATH]

The same Llama (built from a config, seeded, written once with ``save_pretrained``), loaded by both sides
from those files, the same batches, the same loss (cross-entropy on ``.logits``) and the same optimizer
(``torch.optim.AdamW(lr=1e-3)``; trainmesh's side goes through ``prepare_optimizer`` as its docs say),
fp32, one thread per process, gloo on CPU:

* ``tp_step_vs_transformers_tp_{2,4}proc``: trainmesh ``ModelParallel(LayoutMap.auto(...))`` on a
  1 x N mesh, ``distribute_model(meta_model, weights=DIR)``, against
  ``from_pretrained(DIR, distributed_config=DistributedConfig(tp_size=N, tp_plan="auto"))``;
  every process trains on the whole global batch;
* ``zero3_step_vs_transformers_fsdp_{2,4}proc``: ``DataParallel(zero_stage=3)`` against
  ``DistributedConfig(fsdp_size=N)`` (transformers' FSDP2); each process trains on its 1/N of the
  global batch (the same rows on both sides);
* ``pipe_step_vs_transformers_pp``: ``DistributedConfig(pp_size=2)`` is tried for one training step
  on CPU. Where transformers cannot train with it, the figure is left out and ``not_measured`` records
  the reason as the attempt raised it.

Each figure is the median over rounds of (trainmesh's step / transformers' step), the slowest process
deciding each side's time; the sides of a pair run one after the other in a round, alternating which
goes first, after an untimed warm-up round. Same work: the two sides' losses at every step (each process
its own rows) must agree, at the first step to fp32 rounding, afterwards within AdamW's compounding of
rounding (see ``LOSS_*``); else the run prints INVALID and exits 1. Absolute times on a shared CPU are
noise; the per-round ratios are the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

from trainmesh.testing import run_distributed
from trainmesh.testing.stats import ci95

# the model of tensor_parallel.py (its vocabulary larger: the head is a real share of the work)
FULL = dict(hidden=256, ffn=688, layers=4, heads=8, vocab=1024, seq=128, batch=8, rounds=8, steps=3, nproc=(2, 4))
QUICK = dict(FULL, rounds=3, steps=2)
SMOKE = dict(hidden=64, ffn=128, layers=2, heads=4, vocab=256, seq=32, batch=4, rounds=1, steps=1, nproc=(2,))
KINDS = ("tp", "zero3")
PEER = {"tp": "transformers_tp", "zero3": "transformers_fsdp"}
LR = 1e-3
# Same work. First step: the same weights and rows, so the losses differ by fp32 summation order only
# (the two sides reduce in different orders). Later steps: AdamW moves every weight by ~lr whatever the
# gradient's size, so rounding noise in near-zero gradients compounds; a different batch, a skipped or
# doubled reduction or a wrong scale moves the loss by far more than this.
LOSS_FIRST_RTOL = 1e-5
LOSS_RTOL = 1e-3


def llama_config(size: dict):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["ffn"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["heads"],
        max_position_embeddings=size["seq"],
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
        use_cache=False,
    )


def write_model(directory: str, size: dict) -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(size)).float().save_pretrained(directory)


def batches(size: dict) -> list:
    """``steps`` global batches of (inputs, targets), the same on every process and both sides."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, size["vocab"], (size["steps"], size["batch"], size["seq"] + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def local_rows(kind: str, batch):
    """TP: every process trains on the whole batch; ZeRO-3/FSDP: on its 1/N of the rows."""
    import torch.distributed as dist

    if kind == "tp":
        return batch
    n, r = dist.get_world_size(), dist.get_rank()
    return tuple(t.chunk(n)[r] for t in batch)


def trainmesh_side(kind: str, directory: str, size: dict):
    import transformers

    import trainmesh as tm

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(size))
    if kind == "tp":
        mesh = tm.DeviceMesh((1, tm.world_size()), ["data", "model"], devices=tm.list_devices())
        distribution = tm.ModelParallel(layout_map=tm.LayoutMap.auto(model, mesh, verbose=False), batch_dim_name="data")
    else:
        distribution = tm.DataParallel(zero_stage=3)
    model = distribution.distribute_model(model, weights=directory)
    return model, distribution.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=LR), model)


def transformers_side(kind: str, directory: str, size: dict):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    n = dist.get_world_size()
    config = DistributedConfig(tp_size=n, tp_plan="auto") if kind == "tp" else DistributedConfig(fsdp_size=n)
    model = AutoModelForCausalLM.from_pretrained(directory, distributed_config=config, dtype=torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train_step(model, optimizer, rows) -> float:
    x, y = rows
    logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def pipeline_attempt(directory: str) -> str | None:
    """One training step of transformers' ``pp_size=2`` on CPU; None if every stage trained, else why not."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory, distributed_config=DistributedConfig(pp_size=2), dtype=torch.float32
        )
        x = torch.zeros(2, 8, dtype=torch.long)
        logits = model(input_ids=x).logits
        with warnings.catch_warnings():  # torch warns that its broadcast has no autograd kernel: the finding below
            warnings.simplefilter("ignore", UserWarning)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
        untrained = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
        error = f"parameters without a gradient after backward: {untrained[:3]}" if untrained else None
    except Exception as exc:  # the peer's failure is the finding, on whichever stage it happens
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    found = [f"stage {i}: {e}" for i, e in enumerate(errors) if e]
    return "; ".join(found) or None


def _job(directory: str, size: dict, pipe: bool) -> dict:
    import torch.distributed as dist

    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()  # this benchmark's own processes: a table, not bars
    data = batches(size)
    sides = {}
    for kind in KINDS:
        sides[("trainmesh", kind)] = trainmesh_side(kind, directory, size)
        sides[("transformers", kind)] = transformers_side(kind, directory, size)
    losses = {key: [] for key in sides}
    times = {key: [] for key in sides}
    for r in range(size["rounds"] + 1):  # round 0 warms both sides up and is not timed
        for kind in KINDS:
            pair = [("trainmesh", kind), ("transformers", kind)]
            for key in pair if r % 2 else pair[::-1]:
                model, optimizer = sides[key]
                dist.barrier()
                start = time.perf_counter()
                losses[key] += [train_step(model, optimizer, local_rows(kind, b)) for b in data]
                seconds = _slowest(time.perf_counter() - start)
                if r:
                    times[key].append(seconds / len(data))
    out = {
        "times": {f"{s} {k}": v for (s, k), v in times.items()},
        "losses": {f"{s} {k}": v for (s, k), v in losses.items()},
        "optimizer": {
            f"{s} {k}": {name: sides[(s, k)][1].defaults.get(name) for name in ("foreach", "fused")} for (s, k) in sides
        },
    }
    if pipe:
        out["pipe_error"] = pipeline_attempt(directory)
    return out


def same_work(per_rank: list[dict]) -> dict:
    """Per kind: the worst (over processes and steps) relative loss difference, first step and all steps."""
    out = {}
    for kind in KINDS:
        first, worst = 0.0, 0.0
        for result in per_rank:
            a, b = result["losses"][f"trainmesh {kind}"], result["losses"][f"transformers {kind}"]
            rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]
            first, worst = max(first, rel[0]), max(worst, max(rel))
        out[kind] = {
            "first_loss_rel_diff": first,
            "loss_rel_diff_max": worst,
            "valid": first <= LOSS_FIRST_RTOL and worst <= LOSS_RTOL,
        }
    return out


def run(size: dict, directory: str) -> dict:
    figures, detail, not_measured, valid = {}, {}, {}, True
    for n in size["nproc"]:
        per_rank = run_distributed(
            _job, world_size=n, args=(directory, size, n == 2), timeout=1800, collective_timeout=600
        )
        times = per_rank[0]["times"]
        check = same_work(per_rank)
        detail[f"{n}proc"] = {
            "times": times,
            "losses_rank0": per_rank[0]["losses"],
            "same_work": check,
            "optimizer": per_rank[0]["optimizer"],
        }
        for kind in KINDS:
            ratios = [a / b for a, b in zip(times[f"trainmesh {kind}"], times[f"transformers {kind}"])]
            name = f"{kind}_step_vs_{PEER[kind]}_{n}proc"
            detail[f"{n}proc"][name] = {"ratios": ratios, "ci95": ci95(ratios)}
            valid &= check[kind]["valid"]
            figures[name] = round(statistics.median(ratios), 4)
        if n == 2:
            error = per_rank[0]["pipe_error"]
            if error:
                import transformers

                not_measured["pipe_step_vs_transformers_pp"] = (
                    f"transformers {transformers.__version__}'s DistributedConfig(pp_size=2) does not train on "
                    f"CPU: one forward + backward of a 2-stage split raised on {error} (its pipeline forward "
                    "sends the hidden states without autograd and broadcasts the logits from the last stage: "
                    "an inference split, no backward across stages)"
                )
            else:
                not_measured["pipe_step_vs_transformers_pp"] = (
                    "transformers' pp_size=2 trained one step on CPU in this version, but this benchmark does "
                    "not time it yet"
                )
    return {"figures": figures, "not_measured": not_measured, "valid": valid, "detail": detail}


def print_table(size: dict, report: dict) -> None:
    import transformers

    print(
        f"Llama {size['hidden']}x{size['ffn']}, {size['layers']} layers, vocab {size['vocab']}, seq {size['seq']}, "
        f"global batch {size['batch']}, fp32 AdamW(lr={LR}); {size['rounds']} rounds x {size['steps']} steps; "
        f"torch {torch.__version__}, transformers {transformers.__version__}, load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'figure':<38}{'ratio':>8}{'95% of rounds':>18}{'trainmesh s':>13}{'peer s':>10}  same work "
        f"(loss rel diff: first step, worst)"
    )
    for n in size["nproc"]:
        d = report["detail"][f"{n}proc"]
        for kind in KINDS:
            name = f"{kind}_step_vs_{PEER[kind]}_{n}proc"
            low, high = d[name]["ci95"]
            check = d["same_work"][kind]
            print(
                f"{name:<38}{report['figures'][name]:>8.3f}{f'{low:.3f}-{high:.3f}':>18}"
                f"{statistics.median(d['times'][f'trainmesh {kind}']):>13.4f}"
                f"{statistics.median(d['times'][f'transformers {kind}']):>10.4f}  "
                f"{'yes' if check['valid'] else 'NO'} ({check['first_loss_rel_diff']:.1e}, "
                f"{check['loss_rel_diff_max']:.1e})"
            )
    for name, reason in report["not_measured"].items():
        print(f"{name}: not measured: {reason}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds x 2 steps at 2 and 4 processes")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model, 1 round x 1 step, 2 processes: the code path only (the test suite's)",
    )
    parser.add_argument("--nproc", help="comma list of process counts (default 2,4; --smoke 2)")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--json", metavar="PATH", help="write the report (with a top-level 'figures') here")
    args = parser.parse_args(argv)
    size = dict(SMOKE if args.smoke else QUICK if args.quick else FULL)
    if args.nproc:
        size["nproc"] = tuple(int(n) for n in args.nproc.split(","))
    size.update({k: getattr(args, k) for k in ("rounds", "steps") if getattr(args, k)})
    if any(size["batch"] % n for n in size["nproc"]) or min(size["nproc"]) < 2:
        parser.error(
            f"--nproc: each count must be >= 2 and divide the global batch {size['batch']}. Received: {args.nproc}"
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="trainmesh-peer-") as directory:
        write_model(directory, size)
        report = run(size, directory)
    report["config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in size.items()}
    print_table(size, report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.json}")
    if not report["valid"]:
        print("INVALID: the two sides' losses differ beyond fp32 rounding; the timings compare different work")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
