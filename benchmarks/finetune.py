"""LoRA fine-tuning on 4 processes: adapters against full fine-tuning, and trainmesh ZeRO-3 against peft under DDP.

    python benchmarks/finetune.py [--quick] [--rounds R] [--steps S] [--warmup W] [--mem-steps M] [--mem-rounds K]
                                  [--sides a,b,...] [--precision auto|fp32|bf16-mixed] [--seed N] [--json PATH]

Defaults: 8 timing rounds x (1 warmup + 3 timed steps) per side, 2 fresh memory launches per side x 3 steps
(about 8 minutes on 2 cores); ``--quick``: 2 x (1 + 2), 1 launch x 2 steps, about a minute.

The model: a transformers Llama of 100.7M parameters built from a config (hidden 768, 12 layers, MLP 2048,
12 heads and 4 KV heads, vocabulary 16384, untied head; ``--quick``: hidden 128, 2 layers, vocabulary 2048),
initialised once from a seed and written by transformers' ``save_pretrained`` to a scratch directory: the
"pretrained checkpoint" every side starts from. The adapters: peft ``LoraConfig(r=16, lora_alpha=32,
lora_dropout=0)`` on q, k, v, o, gate, up and down projections (2.6M trainable parameters, 2.6%). AdamW
(lr 1e-4, no weight decay, torch's default kernels) over the trainable parameters on every side; 4 gloo
processes of one thread each; sequences of 128 tokens, one per process and step (``--quick``: 2 x 64).

Sides (``--sides``):

* ``tm-full``: full fine-tuning, ``tm.Trainer(model, AdamW, loss, zero_stage=3, weights=DIR)`` over a
  meta-built ``LlamaForCausalLM`` (each process reads only its shards' bytes);
* ``tm-lora``: the same with ``peft.get_peft_model(meta_model, LoraConfig(...))``;
* ``peft-ddp`` (the peer): ``AutoModelForCausalLM.from_pretrained(DIR)`` + ``get_peft_model`` wrapped in
  ``torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)`` (torch's other defaults:
  bucket_cap_mb 25, find_unused_parameters False: every trainable parameter gets a gradient), each process
  slicing its rows of the global batch, a four-line loop (forward, loss, backward, step, zero_grad);
* ``accelerate``: the same peft model through ``Accelerator(cpu=True)`` with the same DDP kwargs (optional:
  left out, said so, when accelerate is not importable);
* ``tm-lora-dp`` (diagnostic): ``tm-lora`` under ``zero_stage=0`` (DDP underneath), to separate what the
  ZeRO-3 layout costs from what the Trainer costs.
* ``tm-lora-regather`` (the same run's "before"): ``tm-lora`` with ``DataParallel(zero_stage=3,
  keep_frozen_gathered=False)``: the frozen base gathered again in backward, as before issue 47 (``tm-lora``
  keeps it gathered from forward to backward, ``_torch/frozen_units.py``).

``--memory-sides`` may add ``tm-full-notrim`` and ``tm-lora-notrim`` (the same launches with
``TRAINMESH_MALLOC_TRIM=0``: no ``malloc_trim`` between steps, ``runtime/memory_trim.py``) and
``tm-lora-regather``: figures ``lora_peak_vs_full_ft_without_trim`` and ``lora_regather_peak_vs_full_ft``;
``tm-full-upcast`` and ``tm-lora-upcast``: the loss before issue 47 (below), figures
``lora_peak_vs_full_ft_upcast_loss`` and ``lora_peak_live_vs_full_ft_upcast_loss``.

The loss, on every side (both trainmesh sides and the peers, so the same work everywhere): trainmesh's
``lm_cross_entropy`` on whole logits, which computes the fp32 mean a block of rows at a time and writes the
gradient in the logits' dtype (``trainmesh/chunked_cross_entropy.py``). Until issue 47 it was
``F.cross_entropy(logits.float())``, which under bf16-mixed holds three fp32 buffers of the logits' size at its
backward (24 MiB a process at 128 tokens x 16k vocabulary): the same values, a lower peak on every side.

Precision: ``--precision auto`` (the default) takes ``fastest_precision("cpu")`` as the demo does;
bf16-mixed means autocast on both sides (the peer: ``torch.autocast("cpu", torch.bfloat16)`` around its
forward, accelerate ``mixed_precision="bf16"``), fp32 master weights, fp32 gradient reduction.

Measurements, each in the same run:

* memory: each of ``tm-full``, ``tm-lora``, ``peft-ddp`` in fresh processes: the peak RSS growth per process
  (``trainmesh.testing.rss.PeakRSSGrowth``: ``VmHWM`` reset before the model is built, so building, loading
  and M steps count), the worst process, the median over launches; beside it, the most tensor bytes alive at
  once while building and during the steps (``trainmesh.testing.memory.LiveTensorBytes``, which sees storages
  made through the dispatcher, not gloo's own buffers), and the bytes glibc malloc holds free at the end
  (``mallinfo2``): RSS = live tensors + what the allocator keeps + gloo's and the interpreter's own;
* gradient bytes: in the same fresh processes, one more step under trainmesh's dispatcher-level collective
  counter (``trainmesh.planner.collectives.CollectiveCounter``, the planner's definition: the full buffer of
  each c10d call; on gloo FSDP2's reduce-scatter is carried by an all-reduce, ``comm/allreduce_scatter.py``,
  and filed as the reduce-scatter it is). The gradient collectives of ZeRO-3 are its reduce-scatters; of DDP its
  bucket all-reduces (calls above 1 KiB: the Trainer's loss and flag all-reduces are a few bytes); a mostly frozen
  model's adapters under ZeRO-3 are replicated and all-reduced in one flat buffer, counted with the reduce-scatters;
* step time: every timed side built in the same 4 processes, rounds interleaved (each side W warmup + S timed
  steps a round, the order rotating and reversing, ``trainer_overhead.round_order``); a Trainer step is the time
  between two ``on_train_batch_end`` callbacks inside ``fit`` (batch fetch, forward/backward, reduction, the
  loss check, step, zero_grad, the loss all-reduce); a step counts as long as its slowest process. Ratios are
  the median of per-round ratios of median steps;
* parity (4 fresh processes of its own, after the timing: nothing left by the timed sides): a small Llama (hidden 64, 2 layers) with LoRA r=16
  (``init_lora_weights=False``: lora_B random, so every adapter moves from the first step), fp32, 10 steps of a
  global batch of 8, under ``ModelParallel`` with ``LayoutMap.auto`` on a (2, 2) ``["data", "model"]`` mesh and
  under ZeRO-3, against a plain one-process peft loop over the same batches: the largest adapter difference.
  The figure's optimizer is SGD (lr 0.5, momentum 0.9), as ``tests/multiprocess/lora_cases.py``'s; the same runs
  with AdamW (lr 1e-2) are reported beside it, with AdamW's own noise on one process (the same batches as 4
  micro-batches against 1), which alone is ~8e-5 after 10 steps: see ``finetune_parity.parity_optimizer``.

Same work: the first step's global loss of every side must agree (fp32: 1e-5 relative; bf16-mixed 2e-2), else
INVALID and exit 1: LoRA starts with lora_B = 0, so at the first step every side computes the base model's loss.

Figures (``--json``): ``lora_grad_bytes_vs_full``, ``lora_peak_vs_full_ft`` (RSS), ``lora_step_vs_full_ft``,
``lora_step_vs_peft_ddp``, ``lora_parity_max_abs_diff``; for context (no goal): ``lora_peak_live_vs_full_ft``,
``lora_steps_peak_live_vs_full_ft``, ``lora_peak_vs_peft_ddp``, ``lora_step_vs_accelerate``,
``lora_dp_step_vs_peft_ddp``, ``lora_gather_bytes_vs_full``, ``lora_parity_adamw_max_abs_diff``,
``adamw_microbatch_noise_1proc``. ``--quick`` is a smoke run for tests (the small Llama, no memory launch for the
peer): too few steps, and too small a model, to judge a goal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the parts beside it, when loaded by path
from finetune_parity import parity_run, parity_summary  # noqa: E402
from finetune_report import print_report, summarize  # noqa: E402
from finetune_sides import WORLD, llama_config, lora_config  # noqa: E402
from finetune_workers import memory_worker, timing_worker  # noqa: E402
from trainer_overhead import round_order  # noqa: E402 - rotating, reversing rounds, as the other step-time benchmarks

SIZES = {
    "full": dict(hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=4, vocab=16384, seq=128, rows=1),
    # --size medium (22M parameters): the full model's shape at half the width and depth, for a loaded machine
    "medium": dict(hidden=384, layers=6, intermediate=1024, heads=6, kv_heads=2, vocab=16384, seq=128, rows=1),
    "quick": dict(hidden=128, layers=2, intermediate=384, heads=4, kv_heads=2, vocab=2048, seq=64, rows=2),
}
ALL_SIDES = ("tm-full", "tm-lora", "peft-ddp", "accelerate", "tm-lora-dp", "tm-lora-regather")
MEMORY_SIDES = ("tm-full", "tm-lora", "peft-ddp")
# --memory-sides may add: the same runs without the allocator trim (memory_trim.py), and LoRA with the frozen
# base gathered again in backward (keep_frozen_gathered=False, the behaviour before issue 47)
EXTRA_MEMORY_SIDES = (
    "tm-full-notrim",
    "tm-lora-notrim",
    "tm-lora-regather",
    # the loss before issue 47's chunked one: F.cross_entropy(logits.float()), three fp32 logits-size buffers
    "tm-full-upcast",
    "tm-lora-upcast",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small Llama, few steps: about a minute")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (default 8; --quick 2)")
    parser.add_argument("--steps", type=int, help="timed steps per side per round (default 3; --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side per round (>= 1)")
    parser.add_argument("--mem-steps", type=int, help="steps in each memory launch (default 3; --quick 2)")
    parser.add_argument("--mem-rounds", type=int, help="fresh launches per side for memory (default 2; --quick 1)")
    parser.add_argument("--sides", default=",".join(ALL_SIDES), help=f"timed sides, of {','.join(ALL_SIDES)}")
    parser.add_argument("--size", choices=tuple(SIZES), help="the model (default full; --quick: quick)")
    parser.add_argument(
        "--memory-sides",
        help=f"memory launches, of {','.join(MEMORY_SIDES + EXTRA_MEMORY_SIDES)} (default: {','.join(MEMORY_SIDES)}; "
        "--quick: the first two)",
    )
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16-mixed"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the report (with a top-level 'figures') here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    sides = [s for s in args.sides.split(",") if s]
    bad_memory = set((args.memory_sides or "").split(",")) - set(MEMORY_SIDES + EXTRA_MEMORY_SIDES) - {""}
    if set(sides) - set(ALL_SIDES) or args.warmup < 1 or bad_memory:
        parser.error(f"--sides must be of {ALL_SIDES}; --warmup >= 1 (a phase's first step carries fit's set-up)")
    skipped = []
    if "accelerate" in sides:
        try:
            import accelerate  # noqa: F401
        except ImportError as error:
            sides.remove("accelerate")
            skipped.append(f"accelerate ({error})")
    if args.precision == "auto":
        from trainmesh.trainer.precision import fastest_precision

        precision, why = fastest_precision("cpu")
    else:
        precision, why = args.precision, "--precision"
    cfg = {
        "quick": args.quick,
        "size": SIZES[args.size or ("quick" if args.quick else "full")],
        "precision": precision,
        "precision_why": why,
        "rounds": args.rounds or (2 if args.quick else 8),
        "steps": args.steps or (2 if args.quick else 3),
        "warmup": args.warmup,
        "mem_steps": args.mem_steps or (2 if args.quick else 3),
        "mem_rounds": args.mem_rounds or (1 if args.quick else 2),
        "sides": sides,
        "seed": args.seed,
        "skipped": skipped,
    }
    import peft
    import transformers

    from trainmesh.testing import run_distributed

    started = time.time()
    load_before = os.getloadavg()[0]
    scratch = tempfile.mkdtemp(prefix="finetune-")
    try:
        cfg["base_dir"] = os.path.join(scratch, "base")
        torch.manual_seed(args.seed)
        base = transformers.LlamaForCausalLM(llama_config(cfg["size"]))
        base.save_pretrained(cfg["base_dir"])
        counts = {"params": sum(p.numel() for p in base.parameters())}
        counts["trainable"] = sum(
            p.numel() for p in peft.get_peft_model(base, lora_config()).parameters() if p.requires_grad
        )
        del base
        # --quick: the two launches the figures need (the peer's peak is context); a launch costs ~25 s here
        memory_sides = list(MEMORY_SIDES[:2] if args.quick else MEMORY_SIDES)
        if args.memory_sides:
            memory_sides = [s for s in args.memory_sides.split(",") if s]
        memory = {side: [] for side in memory_sides}
        for r in range(cfg["mem_rounds"]):
            for side in round_order(memory_sides, r):
                t = time.time()
                memory[side].append(
                    run_distributed(
                        memory_worker, world_size=WORLD, args=(cfg, side), timeout=1800, collective_timeout=900
                    )
                )
                print(f"  memory {side}: {time.time() - t:.0f} s", flush=True)
        t = time.time()
        timing = run_distributed(timing_worker, world_size=WORLD, args=(cfg,), timeout=3600, collective_timeout=900)
        print(f"  timing: {time.time() - t:.0f} s", flush=True)
        t = time.time()
        parity = parity_summary(run_distributed(parity_run, world_size=WORLD, timeout=1800, collective_timeout=900)[0])
        print(f"  parity: {time.time() - t:.0f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = summarize(cfg, memory, timing, parity, counts)
    report.update(
        seconds=time.time() - started,
        load_avg_1min={"before": load_before, "after": os.getloadavg()[0]},
        versions={"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        raw={"memory": memory, "timing_times": [r["times"] for r in timing], "timing_losses": timing[0]["losses"]},
    )
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0 if report["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
