"""Mixture of experts on 4 processes: trainmesh expert parallelism against transformers' own and against ZeRO-3.

    python benchmarks/moe.py [--quick] [--rounds R] [--steps S] [--warmup W] [--dispatch-steps D] [--seed N]
        [--json PATH]

Defaults: 6 interleaved rounds x (1 warmup + 3 timed steps) per side; ``--quick``: 2 x (1 + 2), a tiny model.

The model: a transformers Qwen3-MoE built from a config (hidden 512, 4 layers, 16 experts of intermediate
768, top-2, 8 query and 4 KV heads, vocabulary 16384, untied head: ~100M parameters, ~75M of them experts;
``--quick``: hidden 64, 2 layers, 8 experts of 64, vocabulary 512), initialised once from a seed and written
by transformers' ``save_pretrained`` to a scratch directory; every side loads it with ``from_pretrained``.
Every side trains with the same hand-written step (forward, cross-entropy, backward, AdamW lr 1e-4 with
torch's default kernels, zero_grad) on the same rows: one sequence of 128 tokens per process and step
(``--quick``: 2 x 32), fp32, 4 gloo processes of one thread each.

Sides, all built in the same 4 processes and timed in interleaved rounds (``trainer_overhead.round_order``;
a step counts as long as its slowest process; the 1-minute load average is recorded with each round):

* ``tm-ep4``: ``tm.ModelParallel(layout_map=tm.LayoutMap.auto(model, mesh, expert_axis="data"))`` on a (4,)
  ``["data"]`` mesh: 4 experts per process, dense layers replicated (gradients all-reduced);
* ``tm-ep4-zero3``: the same with ``zero_stage=3``: dense layers sharded by FSDP2 as well;
* ``hf-ep4`` (the peer): ``from_pretrained(DIR, distributed_config=DistributedConfig(ep_size=4, fsdp_size=4))``:
  transformers' own expert parallelism. Its EP borrows the FSDP axis: ``DistributedConfig(ep_size=4)`` alone
  (or with ``dp_replicate_size=4``) is refused ("`ep_size` must divide `fsdp_size * tp_size`"), and with
  ``fsdp_size=4`` every dense parameter is an FSDP2 ``Shard(0)`` over the 4 processes (a unit per decoder
  layer, the embedding alone, norm + head one unit kept gathered after forward). So transformers cannot
  replicate the dense layers under EP; the same work in trainmesh is ``tm-ep4-zero3``;
* ``tm-zero3``: ``tm.DataParallel(zero_stage=3)``: every expert gathered on every process at every step.

Figures (``--json``'s top-level ``figures``):

* ``moe_ep_step_vs_transformers_ep``: ``tm-ep4-zero3`` over ``hf-ep4``: the same layout (experts EP 4, dense
  FSDP2-sharded over the same 4 processes), the like-for-like figure; ``tm-ep4`` over ``hf-ep4`` beside it as
  ``moe_ep_dp_step_vs_transformers_ep``: a layout transformers does not offer (dense replicated, gradients
  all-reduced), so not the same work;
* ``moe_ep_step_vs_zero3``: ``tm-ep4`` over ``tm-zero3``;
* beside the times (not figures): each side's CPU seconds per timed step per process (``getrusage``, every thread,
  gloo's included; mean over the processes, median over the rounds) and the per-round CPU ratios of the two
  transformers comparisons: the work done, which a loaded machine's waits to be scheduled do not inflate;
* ``moe_ep_expert_state_vs_replicated``: the expert parameters, gradients and AdamW state one process holds
  under ``tm-ep4`` (counted from the tensors after a step) over DataParallel's (whole experts: parameters,
  gradients and two AdamW moments, 4x the experts' bytes, from the model's shapes);
* ``moe_dispatch_bytes_vs_formula`` (the issue's name and definition): the all-to-all bytes a step sends to
  other processes, summed over the processes and MoE layers (``expert_parallel.dispatch_stats``: token rows,
  forward and backward), over tokens x hidden x top-k x (EP-1)/EP x 4 x 4 bytes x layers. That formula is
  the expectation at uniform routing (75% of the pairs leave their process at EP 4), so the figure is the
  mean over ``--dispatch-steps`` steps (default 160; ``--quick`` 64) of ``tm-ep4``'s training continued after
  the rounds on fresh rows (forward, backward, AdamW; a new sequence per process and step, seeded), not one
  step. One step cannot estimate it: the rows are drawn alike for every process, so a process's share of
  pairs kept at home is 1/4 in expectation whatever the router prefers, but a sequence's tokens route
  together (on the full model at initialisation, a sequence's remote share has an sd of 0.19-0.23 at layers
  1-3, against 0.027 for 256 independent uniform pairs; its most used process takes 36-77% of its pairs),
  so one step's 4 sequences scatter the figure with an sd of ~0.058 (fraction 0.043 over 60 fresh batches)
  and the same rows repeated do not average it out (the full model's timed rows: a remote share of 0.657 at
  initialisation, 0.731 after the rounds' 24 steps on them in one process (a full run: 0.733); ``--quick``'s: 0.769, a figure of
  1.025, where 64 fresh-row steps gave 1.005 with a standard error of 0.004). The JSON's ``dispatch`` keeps
  every step's figure, their standard error and the one step on the timed rows;
* ``moe_dispatch_bytes_vs_routed_formula``: the same steps' bytes over the formula at the routing that happened:
  the (token, expert) pairs each router sent to an expert on another process (its own bincount) x hidden x
  4 bytes x 4 (dispatch and combine, forward and backward). 1.0 says the dispatch sends those rows and
  nothing else (the forward half agrees by construction; the backward exchanges are what it checks);
* ``moe_remote_pair_fraction``: the share of (token, expert) pairs routed to another process over those steps;
* ``moe_ep_parity_max_abs_diff``: after the rounds, a tiny Qwen3-MoE and Mixtral (``tests/multiprocess/
  moe_cases.py``) under EP 4, EP 4 x ZeRO-3, EP 2 x TP 2 and EP 2 x ZeRO-3 on 4 through ``tm.Trainer``, 3 AdamW
  steps against one process on the same global batches: the largest parameter difference.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "multiprocess"))
from trainer_overhead import round_order  # noqa: E402  rotating, reversing rounds, as the other benchmarks

WORLD = 4
SIDES = ("tm-ep4", "tm-ep4-zero3", "hf-ep4", "tm-zero3")
SIZES = {
    "full": dict(
        hidden=512, layers=4, experts=16, moe_intermediate=768, heads=8, kv_heads=4, vocab=16384, seq=128, rows=1
    ),
    "quick": dict(hidden=64, layers=2, experts=8, moe_intermediate=64, heads=4, kv_heads=2, vocab=512, seq=32, rows=2),
}
TOP_K = 2
# What each step figure compares, in the printout and the JSON (the peer's layout read from its parameters:
# DistributedConfig(ep_size=4, fsdp_size=4) gives every dense parameter Shard(0) over the 4 processes)
COMPARES = {
    "moe_ep_step_vs_transformers_ep": "same work: experts EP 4 and dense FSDP2-sharded on both sides",
    "moe_ep_dp_step_vs_transformers_ep": "not the same work: trainmesh's dense replicated (all-reduce), "
    "which transformers' EP cannot do (ep_size must divide fsdp_size * tp_size)",
    "moe_ep_step_vs_zero3": "EP 4 (dense replicated) over ZeRO-3 gathering every expert",
}
PARITY_LAYOUTS = [  # name, family, mesh shape, axes, expert axis, zero stage, EP (None: the whole axis)
    ("ep4", "qwen3_moe", (4,), ["data"], "data", 0, None),
    ("ep4_zero3", "qwen3_moe", (4,), ["data"], "data", 3, None),
    ("ep2_tp2", "mixtral", (2, 2), ["data", "model"], "data", 0, None),
    ("ep2_zero3_on4", "qwen3_moe", (4,), ["data"], "data", 3, 2),
]


def moe_config(size: dict):
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=4 * size["hidden"],
        moe_intermediate_size=size["moe_intermediate"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        head_dim=size["hidden"] // size["heads"],
        num_experts=size["experts"],
        num_experts_per_tok=TOP_K,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        max_position_embeddings=size["seq"],
    )


def lm_loss(outputs, targets):
    logits = outputs.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_side(side: str, cfg: dict):
    """The model (distributed) and its optimizer, loaded from the saved files."""
    import transformers

    import trainmesh as tm

    if side == "hf-ep4":
        from transformers.distributed import DistributedConfig

        model = transformers.AutoModelForCausalLM.from_pretrained(
            cfg["dir"], dtype=torch.float32, distributed_config=DistributedConfig(ep_size=WORLD, fsdp_size=WORLD)
        )
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg["dir"], dtype=torch.float32)
    if side == "tm-zero3":
        distribution = tm.DataParallel(zero_stage=3)
    else:
        mesh = tm.DeviceMesh((WORLD,), ["data"], devices=tm.list_devices())
        layout_map = tm.LayoutMap.auto(model, mesh, expert_axis="data", verbose=False)
        distribution = tm.ModelParallel(
            layout_map=layout_map, batch_dim_name="data", zero_stage=3 if side == "tm-ep4-zero3" else 0
        )
    model = distribution.distribute_model(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt, x, y) -> tuple[float, float]:
    """One training step: its time on the slowest process, and this process's CPU seconds (every thread:
    the main one and gloo's, from ``getrusage``), which waiting to be scheduled on a loaded machine does
    not inflate as it does the time."""
    import resource

    import torch.distributed as dist

    dist.barrier()
    start, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    now = resource.getrusage(resource.RUSAGE_SELF)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), cpu


def expert_state_bytes(model, opt) -> tuple[int, int]:
    """This process's expert parameters + gradients + AdamW state, in bytes; and the whole experts' bytes."""
    local = full = 0
    for name, param in model.named_parameters():
        if ".experts." not in name:
            continue
        tensor = param.to_local() if hasattr(param, "to_local") else param
        local += tensor.numel() * tensor.element_size()
        full += param.numel() * param.element_size()
        if param.grad is not None:
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            local += grad.numel() * grad.element_size()
        for value in opt.state.get(param, {}).values():
            if torch.is_tensor(value) and value.dim() > 0:
                value = value.to_local() if hasattr(value, "to_local") else value
                local += value.numel() * value.element_size()
    return local, full


def parity() -> dict:
    import trainmesh as tm
    from moe_cases import GLOBAL_BATCH, data, make_optimizer, moe_model
    from moe_cases import lm_loss as case_loss

    out = {}
    for name, family, shape, axes, expert_axis, stage, ep in PARITY_LAYOUTS:
        mesh = tm.DeviceMesh(shape, axes, devices=tm.list_devices())
        model = moe_model(family)
        layout_map = tm.LayoutMap.auto(model, mesh, expert_axis=expert_axis, expert_parallel_size=ep, verbose=False)
        distribution = tm.ModelParallel(layout_map=layout_map, batch_dim_name="data")
        trainer = tm.Trainer(
            model, make_optimizer, case_loss, distribution=distribution, zero_stage=stage, progress=False
        )
        trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
        out[name] = {k: v.detach().clone() for k, v in trainer.state_dict()["model"].items()}
    return out


def timing_worker(cfg: dict) -> dict:
    import torch.distributed as dist

    from trainmesh._torch.expert_parallel import reset_dispatch_stats

    torch.set_num_threads(1)
    rank = dist.get_rank()
    size = cfg["size"]
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    tokens = torch.randint(0, size["vocab"], (WORLD * size["rows"], size["seq"] + 1), generator=g)
    mine = tokens[rank * size["rows"] : (rank + 1) * size["rows"]]
    x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
    sides, skipped = {}, {}
    for side in SIDES:
        try:
            sides[side] = build_side(side, cfg)
        except Exception as error:  # noqa: BLE001  the peer may not run here: recorded, not fatal
            skipped[side] = f"{type(error).__name__}: {error}"[:300]
    times = {side: [] for side in sides}
    cpu = {side: [] for side in sides}  # per round: this process's mean CPU seconds per timed step
    loads = []
    for r in range(cfg["rounds"]):
        for side in round_order(tuple(sides), r):
            model, opt = sides[side]
            for _ in range(cfg["warmup"]):
                step(model, opt, x, y)
            timed = [step(model, opt, x, y) for _ in range(cfg["steps"])]
            times[side].append([t for t, _ in timed])
            cpu[side].append(statistics.fmean(c for _, c in timed))
        loads.append(os.getloadavg()[0])
    cpu_mean = {}  # per side and round: the mean over the processes
    for side, rounds in cpu.items():
        total = torch.tensor(rounds, dtype=torch.float64)
        dist.all_reduce(total)
        cpu_mean[side] = (total / WORLD).tolist()
    model, opt = sides["tm-ep4"]
    reset_dispatch_stats(model)
    lm_loss(model(x), y).backward()
    opt.step()
    state_local, state_full = expert_state_bytes(model, opt)  # gradients and moments both alive here
    opt.zero_grad(set_to_none=True)
    same_rows = step_dispatch(model)
    # The dispatch bytes per step of tm-ep4's training continued on fresh rows (a new sequence per process
    # and step, as training reads them): the formula is their expectation at uniform routing. One
    # step's 4 sequences cannot estimate it: a sequence's tokens route together (see the docstring), so
    # one step's remote share scatters ~0.04 around 0.75 at the full size
    g = torch.Generator().manual_seed(cfg["seed"] + 2)
    per_step = []
    for _ in range(cfg["dispatch_steps"]):
        rows = torch.randint(0, size["vocab"], (WORLD * size["rows"], size["seq"] + 1), generator=g)
        mine = rows[rank * size["rows"] : (rank + 1) * size["rows"]]
        reset_dispatch_stats(model)
        lm_loss(model(mine[:, :-1].contiguous()), mine[:, 1:].contiguous()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        per_step.append(step_dispatch(model))
    sides.clear()
    return {
        "times": times,
        "cpu": cpu_mean,
        "skipped": skipped,
        "loads": loads,
        "dispatch_same_rows": same_rows,
        "dispatch_per_step": per_step,
        "expert_state": (state_local, state_full),
        "parity": parity(),
    }


def step_dispatch(model) -> dict:
    """The last step's all-to-all bytes to other processes, (token, expert) pairs routed to another process
    and pairs routed, summed over the processes and MoE layers; and the MoE layers."""
    import torch.distributed as dist

    from trainmesh._torch.expert_parallel import dispatch_stats

    stats = dispatch_stats(model)
    # (token, expert) pairs this process's router sent to experts on other processes: the routing itself
    # (its bincount), apart from the splits the all-to-alls were called with, which bytes_to_others counts
    rank, remote = dist.get_rank(), 0
    for layer in stats.values():
        counts = layer["tokens_per_expert"]
        per = counts.numel() // WORLD
        remote += int(counts.sum()) - int(counts[rank * per : (rank + 1) * per].sum())
    sent = torch.tensor(
        [
            sum(layer["bytes_to_others"] for layer in stats.values()),
            remote,
            sum(int(layer["tokens_per_expert"].sum()) for layer in stats.values()),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(sent)
    return {"bytes": float(sent[0]), "remote": float(sent[1]), "routed": float(sent[2]), "layers": len(stats)}


def summarize(cfg: dict, result: dict, counts: dict) -> dict:
    medians = {side: [statistics.median(r) for r in rounds] for side, rounds in result["times"].items()}
    report = {
        "config": {k: v for k, v in cfg.items() if k != "dir"},
        "params": counts,
        "skipped": result["skipped"],
        "loads_per_round": result["loads"],
        "step_seconds": {},
        "ratios": {},
    }
    for side, values in medians.items():
        report["step_seconds"][side] = {"median": statistics.median(values), "min": min(values), "max": max(values)}

    def ratio(a: str, b: str):
        if a not in medians or b not in medians:
            return None
        per_round = [x / y for x, y in zip(medians[a], medians[b])]
        report["ratios"][f"{a} / {b}"] = {
            "median": statistics.median(per_round),
            "min": min(per_round),
            "max": max(per_round),
        }
        return statistics.median(per_round)

    # CPU seconds per step per process (mean over the processes, median over the rounds) and their
    # per-round ratios: the work each side does, apart from the waits a loaded machine adds to the times
    report["cpu_step_seconds"] = {side: statistics.median(v) for side, v in result["cpu"].items()}
    report["cpu_ratios"] = {}
    for name, a, b in (
        ("moe_ep_step_vs_transformers_ep", "tm-ep4-zero3", "hf-ep4"),
        ("moe_ep_dp_step_vs_transformers_ep", "tm-ep4", "hf-ep4"),
    ):
        if a in result["cpu"] and b in result["cpu"]:
            per_round = [x / y for x, y in zip(result["cpu"][a], result["cpu"][b])]
            report["cpu_ratios"][f"{a} / {b}"] = {
                "median": statistics.median(per_round),
                "min": min(per_round),
                "max": max(per_round),
            }
    figures = {}
    for name, a, b in (
        ("moe_ep_step_vs_transformers_ep", "tm-ep4-zero3", "hf-ep4"),
        ("moe_ep_dp_step_vs_transformers_ep", "tm-ep4", "hf-ep4"),
        ("moe_ep_step_vs_zero3", "tm-ep4", "tm-zero3"),
    ):
        value = ratio(a, b)
        if value is not None:
            figures[name] = value
    local, full = result["expert_state"]
    figures["moe_ep_expert_state_vs_replicated"] = local / (4 * full)
    figures.update(dispatch_figures(cfg, result, report))
    figures["moe_ep_parity_max_abs_diff"] = max(result["parity_diffs"].values())
    report["parity_diffs"] = result["parity_diffs"]
    report["compares"] = {name: what for name, what in COMPARES.items() if name in figures}
    report["figures"] = figures
    return report


def dispatch_figures(cfg: dict, result: dict, report: dict) -> dict:
    """The issue's formula (uniform routing: (EP-1)/EP of the pairs leave their process) against the mean
    bytes per step over the fresh-row steps, and the same formula at the pairs the router actually sent away;
    the first measures the routing, the second the dispatch (rows x hidden x 4 bytes, dispatch and combine,
    forward and backward, nothing more). The report keeps each step's figure, their standard error and the
    figure of the one step on the timed rounds' rows."""
    size = cfg["size"]
    steps = result["dispatch_per_step"]
    layers = result["dispatch_same_rows"]["layers"]
    tokens = WORLD * size["rows"] * size["seq"]
    uniform = tokens * size["hidden"] * TOP_K * (WORLD - 1) / WORLD * 4 * 4 * layers  # bytes per step
    ratios = [s["bytes"] / uniform for s in steps]
    same = result["dispatch_same_rows"]
    report["dispatch"] = {
        "steps": len(steps),
        "per_step_vs_formula": ratios,
        "per_step_sd": statistics.stdev(ratios) if len(ratios) > 1 else None,
        "standard_error": statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None,
        "timed_rows_step_vs_formula": same["bytes"] / uniform,
        "timed_rows_remote_pair_fraction": same["remote"] / same["routed"],
    }
    remote = sum(s["remote"] for s in steps)
    return {
        "moe_dispatch_bytes_vs_formula": statistics.fmean(ratios),
        "moe_dispatch_bytes_vs_routed_formula": sum(s["bytes"] for s in steps) / (remote * size["hidden"] * 4 * 4),
        "moe_remote_pair_fraction": remote / sum(s["routed"] for s in steps),
    }


def print_report(report: dict) -> None:
    print(
        f"\nQwen3-MoE, {report['params']['total'] / 1e6:.1f}M parameters ({report['params']['experts'] / 1e6:.1f}M "
        f"in experts), {WORLD} gloo processes"
    )
    print(f"{'side':<16}{'median s/step':>14}{'min':>10}{'max':>10}{'CPU s/step/process':>20}")
    for side, s in report["step_seconds"].items():
        cpu = report["cpu_step_seconds"].get(side, float("nan"))
        print(f"{side:<16}{s['median']:>14.4f}{s['min']:>10.4f}{s['max']:>10.4f}{cpu:>20.4f}")
    for side, why in report["skipped"].items():
        print(f"{side:<16} not run: {why}")
    print(f"\n{'ratio':<34}{'median':>10}{'min':>10}{'max':>10}")
    for name, r in report["ratios"].items():
        print(f"{name:<34}{r['median']:>10.3f}{r['min']:>10.3f}{r['max']:>10.3f}")
    for name, r in report["cpu_ratios"].items():
        print(f"{'CPU ' + name:<34}{r['median']:>10.3f}{r['min']:>10.3f}{r['max']:>10.3f}")
    print("\nfigures:")
    for name, value in report["figures"].items():
        print(f"  {name:<40}{value:.4g}")
    for name, what in report.get("compares", {}).items():
        print(f"  {name}: {what}")
    d = report["dispatch"]
    if d["standard_error"] is not None:
        print(
            f"  dispatch bytes over the formula: mean of {d['steps']} fresh-row steps, standard error "
            f"{d['standard_error']:.4f} (one step's sd {d['per_step_sd']:.4f}); the timed rounds' rows alone: "
            f"{d['timed_rows_step_vs_formula']:.4f} (remote share {d['timed_rows_remote_pair_fraction']:.4f})"
        )
    print(f"load average per round: {[round(v, 2) for v in report['loads_per_round']]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds of 2 steps")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 6; --quick 2)")
    parser.add_argument("--steps", type=int, help="timed steps per side per round (default 3; --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side per round")
    parser.add_argument(
        "--dispatch-steps", type=int, help="tm-ep4 steps on fresh rows for the dispatch bytes (default 160; --quick 64)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the report (with a top-level 'figures') here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import transformers

    from moe_cases import reference
    from trainmesh.testing import run_distributed

    size = SIZES["quick" if args.quick else "full"]
    cfg = {
        "quick": args.quick,
        "size": size,
        "rounds": args.rounds or (2 if args.quick else 6),
        "steps": args.steps or (2 if args.quick else 3),
        "warmup": args.warmup,
        "dispatch_steps": args.dispatch_steps or (64 if args.quick else 160),
        "seed": args.seed,
    }
    started, scratch = time.time(), tempfile.mkdtemp(prefix="moe-")
    try:
        cfg["dir"] = os.path.join(scratch, "model")
        torch.manual_seed(args.seed)
        model = transformers.Qwen3MoeForCausalLM(moe_config(size))
        model.save_pretrained(cfg["dir"])
        counts = {
            "total": sum(p.numel() for p in model.parameters()),
            "experts": sum(p.numel() for n, p in model.named_parameters() if ".experts." in n),
        }
        del model
        result = run_distributed(timing_worker, world_size=WORLD, args=(cfg,), timeout=3600, collective_timeout=900)[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    got = result.pop("parity")
    result["parity_diffs"] = {}
    for name, family, *_ in PARITY_LAYOUTS:
        want = reference(family)["params"]
        result["parity_diffs"][name] = max((got[name][k] - want[k]).abs().max().item() for k in want)
    report = summarize(cfg, result, counts)
    report.update(
        seconds=time.time() - started, versions={"torch": torch.__version__, "transformers": transformers.__version__}
    )
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
