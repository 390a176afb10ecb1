"""Compiled vs eager steps, and the demo's MFU, on 4 gloo processes.

    python benchmarks/throughput.py [--rounds R] [--steps S] [--quick] [--json PATH] [--device cpu|cuda] [--processes N]
                                     [--compile-mode MODE]

Models: the demo's character GPT (its default size and step, read from ``DemoSettings.full()``:
one micro-batch of 32 windows of 64 per process) and a Llama-style transformers ``LlamaForCausalLM`` built from a small
config (no download; 2 micro-batches of 16 sequences of 64 per process), each under DataParallel and ZeRO-3, eager (``compile=False``) against
compiled (``compile="regional"``, each decoder block). Both variants of a pair are built by the
Trainer in the same processes and step through the Trainer's own ``forward_backward`` plus the
optimizer step, on the same batches; rounds alternate the order (eager first, then compiled
first). Compile time (the first step) is reported apart and kept out of the step medians.

Figures (``--json``): ``compiled_vs_eager_step_gpt`` (GPT, DataParallel, median step time
compiled / eager), ``compiled_vs_eager_step_llama_zero3``, ``compiled_parity_max_abs_diff``
(fp32, 4 SGD steps, parameters of compiled vs eager, max over GPT/DP and Llama/ZeRO-3) and
``demo_mfu_vs_bf16_peak`` (the demo GPT's model FLOPs per second on its default path under
DataParallel / this node's matmul ceiling measured by the ``trainmesh env --peak`` probe in the
same run, before the workers start: one thread's rate per second of its own CPU time, times the
cores, which load from elsewhere on a shared machine cannot lower, so it cannot flatter the MFU).

Precision: what the demo runs in on this machine (``trainmesh.trainer.precision.fastest_precision``,
as ``trainmesh demo`` decides it): bf16-mixed where bf16 matmuls are native (AMX, AVX512-BF16),
fp32 on a CPU without them (AVX2 only: bf16 matmuls there run ~45x slower than fp32, and no one
would train in them). Both sides of every pair use it. The probe measures both the bf16 and the
fp32 ceiling, and ``demo_mfu_vs_bf16_peak`` divides by the higher of the two: on a CPU without
native bf16 its bf16 ceiling is ~40x below what the demo reaches in fp32, and an MFU against it
would read 20 (2,000%), so there the figure is taken against the fp32 ceiling the demo can use
(the report names the one used; ``demo_mfu_vs_<dtype>_peak`` repeats it under the name of that
dtype). ``--precision`` forces one. ``--device cuda`` runs the same per-process steps with one
process per GPU (NCCL), in the GPU's precision (bf16-mixed), against the GPU's measured peak: its figures
describe that GPU, and the goals above are this benchmark's CPU goals.
``--quick`` runs the two pairs the figures come from (GPT under DataParallel, Llama under ZeRO-3)
with fewer rounds and steps (4 rounds of 3: with 2, one commit's Llama ZeRO-3 pair read 1.006 and
0.925, a median of two rounds being their mean).
Exit 1 and INVALID when the two sides of a pair did not do the same work (different step counts,
or losses apart by more than mixed-precision noise).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from trainmesh.testing import run_distributed
from trainmesh.testing.stats import median_ci95
from trainmesh.trainer.precision import compute_dtype, dtype_short_name

WORLD = 4
GPT_VOCAB, SEQ = 96, 64
LOSS_TOLERANCE = 0.05  # compiled and eager losses after equal steps (nats; bf16-mixed noise, far above fp32's)


def build(model_name: str):
    from trainmesh.demo.char_gpt import CharGPT, GPTConfig, lm_loss
    from trainmesh.demo.job import DemoSettings

    torch.manual_seed(0)
    if model_name == "gpt":
        s = DemoSettings.full()
        model = CharGPT(
            GPTConfig(
                vocab_size=GPT_VOCAB, block_size=s.block_size, n_layer=s.n_layer, n_head=s.n_head, d_model=s.d_model
            )
        )
        return model, lm_loss, GPT_VOCAB
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config), lambda out, y: lm_loss(out.logits, y), 256


def shapes() -> dict[str, tuple[int, int]]:
    """(rows per micro-batch per process, micro-batches per step) of each model: the demo's own step for
    the GPT (its global batch over WORLD processes and its accumulation), 2 x 16 for the Llama."""
    from trainmesh.demo.job import DemoSettings

    s = DemoSettings.full()
    return {"gpt": (s.global_batch_for(WORLD) // (s.grad_accum_steps * WORLD), s.grad_accum_steps), "llama": (16, 2)}


def batches(vocab: int, n: int, rows: int, seed: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of token windows, made on the host from ``seed`` and placed on ``device`` ahead of the
    timed steps (on a GPU, this process's own)."""
    import trainmesh as tm

    place = torch.device("cuda", tm.local_rank()) if device == "cuda" else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, SEQ + 1), generator=g)
        out.append((ids[:, :-1].contiguous().to(place), ids[:, 1:].contiguous().to(place)))
    return out


def make_trainer(
    model_name: str,
    stage: int,
    mode,
    precision: str,
    optimizer=torch.optim.AdamW,
    lr=1e-3,
    compile_mode: str | None = None,
):
    import trainmesh as tm

    model, loss_fn, vocab = build(model_name)
    # The demo's optimizer kernels (fused AdamW; FSDP2's DTensor shards get foreach) on both sides.
    trainer = tm.Trainer(
        model,
        optimizer(model.parameters(), lr=lr),
        loss_fn,
        distribution=tm.DataParallel(zero_stage=stage),
        precision=precision,
        compile=mode,
        optimizer_implementation="fused",
        progress=False,
        compile_mode=compile_mode if mode else None,
    )
    return trainer, vocab


def step(trainer, micro_batches) -> float:
    from trainmesh.trainer.loss_tracking import LossAccumulator
    from trainmesh.trainer.step import forward_backward

    losses = LossAccumulator()
    forward_backward(trainer.model, micro_batches, trainer.loss_fn, trainer.precision, losses)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(losses._step_sum / losses._step_samples)


def worker(cfg: dict) -> dict:
    import torch.distributed as dist

    import trainmesh as tm
    from trainmesh._torch.compile import compiled_mode

    rank, out = tm.rank(), {"pairs": {}, "parity": {}}
    for pair in cfg["pairs"]:
        model_name, stage = pair.split("/")
        micro, accum = cfg["shape"][model_name]
        stage = int(stage.removeprefix("zero"))
        sides = {
            "eager": make_trainer(model_name, stage, False, cfg["precision"]),
            "compiled": make_trainer(model_name, stage, "regional", cfg["precision"], compile_mode=cfg["compile_mode"]),
        }
        vocab = sides["eager"][1]
        data = batches(vocab, accum * (cfg["rounds"] * cfg["steps"] + 1), micro, seed=1000 + rank, device=cfg["device"])
        times = {side: [] for side in sides}
        losses = {side: [] for side in sides}
        first = {}
        for side, (trainer, _) in sides.items():  # step 1: compilation (and the eager side's warm-up)
            dist.barrier()
            started = time.perf_counter()
            losses[side].append(step(trainer, data[:accum]))
            first[side] = time.perf_counter() - started
        for r in range(cfg["rounds"]):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                trainer = sides[side][0]
                for s in range(cfg["steps"]):
                    index = 1 + r * cfg["steps"] + s
                    dist.barrier()
                    started = time.perf_counter()
                    losses[side].append(step(trainer, data[index * accum : (index + 1) * accum]))
                    times[side].append(time.perf_counter() - started)
        out["pairs"][pair] = {
            "times": times,
            "losses": losses,
            "first_step_s": first,
            "compiled": compiled_mode(sides["compiled"][0].unwrapped_model),
        }
        if pair == "gpt/zero0" and rank == 0:
            from trainmesh.trainer.throughput import count_flops_per_sample, meta_copy

            model, loss_fn, _ = build("gpt")
            out["gpt_flops_per_sample"] = count_flops_per_sample(
                meta_copy(model), data[0][0], data[0][1], loss_fn, rows=micro
            )
        del sides
    for pair in cfg["parity"]:  # fp32: the compiled path computes what eager computes
        model_name, stage = pair.split("/")
        stage = int(stage.removeprefix("zero"))
        micro = cfg["shape"][model_name][0]
        params = {}
        for side, mode in (("eager", False), ("compiled", "regional")):
            # SGD: the parameters then differ by what the gradients differ by; Adam's normalisation would
            # blow a 1e-9 difference in a near-zero gradient up to a full lr-sized step.
            trainer, vocab = make_trainer(
                model_name, stage, mode, "fp32", torch.optim.SGD, 0.1, compile_mode=cfg["compile_mode"]
            )
            for batch in batches(vocab, 4, micro, seed=2000 + rank, device=cfg["device"]):
                step(trainer, [batch])
            params[side] = trainer.state_dict()["model"]
        if rank == 0:
            out["parity"][pair] = max(
                (params["compiled"][k] - params["eager"][k]).abs().max().item() for k in params["eager"]
            )
    return out


def summarize(results: list[dict], cfg: dict) -> dict:
    report, valid = {"pairs": {}}, True
    peak = cfg["peaks"][cfg["peak_dtype"]]
    for pair in cfg["pairs"]:
        per = [res["pairs"][pair] for res in results]
        # A step is as slow as its slowest process.
        steps = {side: [max(ts) for ts in zip(*(p["times"][side] for p in per))] for side in ("eager", "compiled")}
        med = {side: statistics.median(v) for side, v in steps.items()}
        ratios = [c / e for c, e in zip(steps["compiled"], steps["eager"])]
        final = {side: [p["losses"][side][-1] for p in per] for side in ("eager", "compiled")}
        same = (
            len(steps["eager"]) == len(steps["compiled"])
            and per[0]["compiled"] == "regional"
            and max(abs(a - b) for a, b in zip(final["eager"], final["compiled"])) <= LOSS_TOLERANCE
        )
        valid &= same
        report["pairs"][pair] = {
            "eager_ms": 1e3 * med["eager"],
            "compiled_ms": 1e3 * med["compiled"],
            "ratio": med["compiled"] / med["eager"],
            "ratio_ci95_of_step_ratios": median_ci95(ratios),
            "eager_ms_ci95": tuple(1e3 * v for v in median_ci95(steps["eager"])),
            "first_step_s": {side: max(p["first_step_s"][side] for p in per) for side in ("eager", "compiled")},
            "final_losses": final,
            "same_work": same,
            "steps": len(steps["eager"]),
        }
    figures = {}
    if "gpt/zero0" in report["pairs"]:
        figures["compiled_vs_eager_step_gpt"] = report["pairs"]["gpt/zero0"]["ratio"]
        flops = results[0].get("gpt_flops_per_sample")
        demo = report["pairs"]["gpt/zero0"]
        seconds = demo["eager_ms"] / 1e3  # the demo's default path (eager: see benchmarks/README.md)
        samples = math.prod(cfg["shape"]["gpt"]) * cfg["world"]
        report["demo_model_flops_per_s"] = flops * samples / seconds if flops else None
        if flops and peak:
            figures["demo_mfu_vs_bf16_peak"] = report["demo_model_flops_per_s"] / peak
            if cfg["peak_dtype"] != "bf16":
                figures[f"demo_mfu_vs_{cfg['peak_dtype']}_peak"] = figures["demo_mfu_vs_bf16_peak"]
            # from the 95% interval of the median eager step (the probe's peak is one number)
            slow, fast = (flops * samples / (ms / 1e3) / peak for ms in reversed(demo["eager_ms_ci95"]))
            report["demo_mfu_ci95"] = (slow, fast)
    if "llama/zero3" in report["pairs"]:
        figures["compiled_vs_eager_step_llama_zero3"] = report["pairs"]["llama/zero3"]["ratio"]
    if results[0]["parity"]:
        figures["compiled_parity_max_abs_diff"] = max(results[0]["parity"].values())
    report.update(
        figures=figures,
        parity=results[0]["parity"],
        precision=cfg["precision"],
        device=cfg["device"],
        processes=cfg["world"],
        peak_dtype=cfg["peak_dtype"],
        peak_flops=peak,
        compile_mode=cfg["compile_mode"],
        peaks_measured=cfg["peaks"],
        valid=valid,
    )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="alternating rounds per pair (default 6; --quick 4)")
    parser.add_argument("--steps", type=int, help="timed steps per side per round (default 5; --quick 3)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the figures' pairs (GPT under DataParallel, Llama under ZeRO-3), few steps",
    )
    parser.add_argument("--json", metavar="PATH", help="write the report (with a top-level 'figures') here")
    parser.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16-mixed"),
        default="auto",
        help="both sides' precision (default auto: what the demo picks on this machine)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo processes of one thread; cuda: one process per GPU, NCCL (the same per-process "
        "steps; the figures then describe that GPU, not this benchmark's CPU goals)",
    )
    parser.add_argument(
        "--compile-mode",
        help="torch.compile's mode for the compiled side (default: torch's; 'reduce-overhead' replays CUDA graphs)",
    )
    parser.add_argument("--processes", type=int, help=f"processes (default {WORLD} on cpu, one per GPU on cuda)")
    args = parser.parse_args(argv)
    world = args.processes or (torch.cuda.device_count() if args.device == "cuda" else WORLD)
    if world < 1:
        parser.error(f"--processes must be >= 1 (with --device cuda, a GPU must be visible); got {world}")
    pairs = ["gpt/zero0", "llama/zero3"] if args.quick else ["gpt/zero0", "gpt/zero3", "llama/zero0", "llama/zero3"]
    parity = ["gpt/zero0", "llama/zero3"]
    cfg = {
        "pairs": pairs,
        "parity": parity,
        "rounds": args.rounds or (4 if args.quick else 6),
        "steps": args.steps or (3 if args.quick else 5),
        "shape": shapes(),
        "world": world,
        "device": args.device,
        "compile_mode": args.compile_mode,
    }
    from trainmesh.trainer.precision import fastest_precision
    from trainmesh.trainer.throughput import measure_peak_flops

    precision, why = (args.precision, "--precision") if args.precision != "auto" else fastest_precision(args.device)
    cfg["precision"] = precision
    # the node's ceilings (a CPU's cores; on cuda one GPU's, times the GPUs used), before the workers
    # start; the MFU divides by the higher (see the module doc)
    devices = world if args.device == "cuda" else 1
    cfg["peaks"] = {
        dtype_short_name(d): devices * measure_peak_flops(d, device_type=args.device, seconds=3.0, save=False)
        for d in sorted({torch.bfloat16, compute_dtype(precision)}, key=str)
    }
    cfg["peak_dtype"] = max(cfg["peaks"], key=cfg["peaks"].get)
    results = run_distributed(
        worker, world_size=world, args=(cfg,), timeout=3000, collective_timeout=900, device=args.device
    )
    report = summarize(results, cfg)
    name = cfg["peak_dtype"]
    where = (
        f"{world} processes, 1 thread each"
        if args.device == "cpu"
        else f"{world} process(es), one per GPU ({torch.cuda.get_device_name()})"
    )
    print(
        f"{where}; precision {precision} ({why}); matmul peaks of the processes' devices: "
        + ", ".join(f"{d} {v / 1e9:.0f} GFLOP/s" for d, v in cfg["peaks"].items())
        + f"; the MFU divides by the higher ({name})"
    )
    if cfg["compile_mode"]:
        print(f"compiled side: torch.compile mode {cfg['compile_mode']!r}")
    print(
        f"both sides: {precision}, fused AdamW (foreach on ZeRO-3 shards), the same batches; rows x micro-batches "
        "per process and step: " + ", ".join(f"{m} {r} x {k}" for m, (r, k) in cfg["shape"].items())
    )
    header = (
        f"{'pair':<14}{'eager ms':>10}{'compiled ms':>13}{'ratio':>8}{'95% CI':>16}{'compile s':>11}{'same work':>11}"
    )
    print(header + "\n" + "-" * len(header))
    for pair, p in report["pairs"].items():
        low, high = p["ratio_ci95_of_step_ratios"]
        print(
            f"{pair:<14}{p['eager_ms']:>10.1f}{p['compiled_ms']:>13.1f}{p['ratio']:>8.3f}"
            f"{f'{low:.3f}-{high:.3f}':>16}{p['first_step_s']['compiled']:>11.1f}{str(p['same_work']):>11}"
        )
    intervals = {
        "compiled_vs_eager_step_gpt": report["pairs"].get("gpt/zero0", {}).get("ratio_ci95_of_step_ratios"),
        "compiled_vs_eager_step_llama_zero3": report["pairs"].get("llama/zero3", {}).get("ratio_ci95_of_step_ratios"),
        **{n: report.get("demo_mfu_ci95") for n in report["figures"] if n.startswith("demo_mfu_vs_")},
    }
    for name, value in report["figures"].items():
        ci = intervals.get(name)
        print(f"{name} = {value:.4g}" + (f"  (95% CI {ci[0]:.3g}-{ci[1]:.3g})" if ci else ""))
    if not report["valid"]:
        print("INVALID: compiled and eager did not do the same work (steps, compilation or losses differ)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
