"""Models bigger than one process: what building, loading and saving a Hugging Face Llama costs.

    python benchmarks/big_model.py [--quick] [--rounds 2] [--dir DIR] [--json PATH]

The model: a transformers Llama of ~0.44B parameters (hidden 1536, 12 layers, MLP 4096, vocabulary
32000: 1.75 GB in fp32; ``--quick``: hidden 768, 6 layers, MLP 2048, 0.09B), written once by
transformers' own ``save_pretrained`` as a sharded directory (500 MB files). Page cache warm (the
directory is read once before the first round). Each measurement runs in fresh processes (4 of
them, gloo, one thread each), so one side's freed memory never hides the other's growth, and every
process first loads a tiny model the same way, so imports and first-call costs stay out of the
times. Rounds interleave the sides, rotating which goes first.

Sides, per round:

* ``trainmesh zero3``: ``DataParallel(zero_stage=3).distribute_model(meta_model, weights=DIR)``;
* ``trainmesh tp``: ``ModelParallel`` on mesh (1, 4) with ``LayoutMap.auto``, the same call;
* ``transformers fsdp``: ``AutoModelForCausalLM.from_pretrained(DIR,
  distributed_config=DistributedConfig(fsdp_size=4))`` (transformers' own distributed load);
* ``single read``: one process reading every file with ``safetensors.torch.load_file``;
* ``copy limit``: one process ``readinto`` every whole file into memory allocated (not touched)
  before the clock starts: the physical copy from the page cache plus first-touch faults, which any
  load into fresh memory pays;
* ``first step``: ``trainmesh zero3`` and ``transformers fsdp`` again, each timed from the build to
  the end of one AdamW step (lr 1e-4, ``prepare_optimizer`` on trainmesh's side, a plain loop on
  transformers') on the same global batch of 4 rows of 32 tokens, each process taking its row.
  transformers' lazily mapped tensors pay their copy in that step, ours in the load: the step is
  where both have done the same work;
* ``trainmesh save``: ``tm.save_pretrained`` of the ZeRO-3 model on 4 processes, against
  ``transformers save``: ``save_pretrained`` of the whole model on one process (both 500 MB files,
  both fsynced: tm.save_pretrained fsyncs before it publishes, transformers' side is fsynced after).
  Each trainmesh process first saves the tiny model, as it first loads one: transformers' save runs in
  the main process, which has already saved twice (the directories), so neither side's time holds
  first-call costs. (Until this was added the trainmesh side paid them: about 1.2 s of CPU per process
  in transformers' weight-conversion tables on the first save, which the figure then counted.)

Memory is each process's peak RSS growth over the step (``/proc`` high-water mark reset at its
start), with every local shard touched once after loading (a lazily mapped file shows only what is
touched), over the model's full fp32 bytes; the worst process counts. A load's time runs to the end
of that touch on both sides (transformers maps files lazily: its tensors are read when first used),
and the single read touches every tensor too. Times are the slowest process's wall time. Figures
are medians over rounds; ratios are formed per round.

``hf_time_to_first_step_vs_transformers_distributed`` is the first-step time over transformers'
(goal <= 1.0; the slowest process's phases are printed and kept: ready, forward, backward, AdamW,
each in wall and CPU seconds); ``hf_load_time_vs_copy_limit`` our ZeRO-3 load (build to filled shards, no touch)
over the copy limit (goal <= 2.0).

Initialisation without weights: the largest difference between the parameters that DataParallel,
ZeRO-3, TP 2x2, TP 1x4 and pipeline 2 give a small meta-built Llama at one seed, against one
process initialising it unsharded (each process compares the region it holds).
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

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {
    "full": dict(hidden=1536, layers=12, intermediate=4096),
    "quick": dict(hidden=768, layers=6, intermediate=2048),
    # --smoke: the code path only (hidden 768 is the least that gives 4 heads and 4 KV heads to split 4 ways)
    "smoke": dict(hidden=768, layers=2, intermediate=256, vocab=512),
}
SHARD = "500MB"


def llama_config(hidden: int, layers: int, intermediate: int, vocab: int = 32000):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        # heads of 96 (16 at hidden 1536) and half as many KV heads: both split 4 ways
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 96, 2),
        num_key_value_heads=max(hidden // 192, 1),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _meta_model(config):
    import transformers

    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _touch(model) -> float:
    with torch.no_grad():
        return sum(float((p.to_local() if hasattr(p, "to_local") else p).float().sum()) for p in model.parameters())


def _load(side: str, directory: str, config):
    import trainmesh as tm

    if side == "transformers fsdp":
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        return AutoModelForCausalLM.from_pretrained(directory, distributed_config=DistributedConfig(fsdp_size=4))
    model = _meta_model(config)
    if side == "trainmesh zero3":
        return tm.DataParallel(zero_stage=3).distribute_model(model, weights=directory)
    mesh = tm.DeviceMesh((1, 4), ["data", "model"], devices=tm.list_devices())
    layout = tm.LayoutMap.auto(model, mesh, verbose=False)
    return tm.ModelParallel(layout_map=layout, batch_dim_name="data").distribute_model(model, weights=directory)


STEP_BATCH = (4, 32)  # global rows x tokens of the first step; each of the 4 processes trains on one row


def _first_step_batch(vocab: int):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (STEP_BATCH[0], STEP_BATCH[1] + 1), generator=g)
    rows = tokens.chunk(dist.get_world_size())[dist.get_rank()]
    return rows[:, :-1], rows[:, 1:]


PHASES = ("ready", "forward", "backward", "adamw")  # the first step's phases, timed on every process


def _build_and_step(side: str, directory: str, config) -> tuple[float, dict]:
    """Build, load and take one AdamW step: (the loss, each phase's wall and CPU seconds on this process).
    "ready" runs to the model and optimizer built and loaded; CPU seconds (``time.process_time``, every
    thread of the process) tell work from waiting for the other processes or for a core."""
    import trainmesh as tm

    phases, wall, cpu = {}, time.perf_counter(), time.process_time()

    def lap(name):
        nonlocal wall, cpu
        now, now_cpu = time.perf_counter(), time.process_time()
        phases[name], phases[f"{name}_cpu"] = now - wall, now_cpu - cpu
        wall, cpu = now, now_cpu

    if side == "trainmesh zero3":
        distribution = tm.DataParallel(zero_stage=3)
        model = distribution.distribute_model(_meta_model(config), weights=directory)
        optimizer = distribution.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), model)
    else:
        model = _load(side, directory, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lap("ready")
    x, y = _first_step_batch(config.vocab_size)
    loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
    lap("forward")
    loss.backward()
    lap("backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lap("adamw")
    return loss.item(), phases


def _first_step_worker(side: str, directory: str, tiny: str, sizes: dict) -> dict:
    import torch.distributed as dist

    import trainmesh as tm

    tm.initialize()
    _build_and_step(side, tiny, llama_config(64, 2, 128, vocab=512))  # imports and first calls, outside the figure
    config = llama_config(**sizes)
    dist.barrier()
    start = time.perf_counter()
    loss, phases = _build_and_step(side, directory, config)
    return {"seconds": time.perf_counter() - start, "loss": loss, **phases}


def _copy_limit(directory: str) -> float:
    """One process reading every whole file, with ``readinto``, into memory allocated beforehand."""
    paths = [os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.endswith(".safetensors")]
    buffers = [torch.empty(os.path.getsize(p), dtype=torch.uint8) for p in paths]  # allocated, not touched
    start = time.perf_counter()
    for path, buffer in zip(paths, buffers):
        view, done = memoryview(buffer.numpy()), 0
        with open(path, "rb", buffering=0) as f:
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise OSError(f"{path}: shorter than its size")
                done += got
    return time.perf_counter() - start


def _load_worker(side: str, directory: str, tiny: str, sizes: dict) -> dict:
    import torch.distributed as dist

    import trainmesh as tm
    from trainmesh.testing.rss import PeakRSSGrowth

    tm.initialize()
    warm = _load(side, tiny, llama_config(64, 2, 128, vocab=512))
    _touch(warm)  # imports and first calls, outside the figures
    if side == "trainmesh zero3":  # the save's too: transformers' side saves in the main process, which has
        # saved twice before (the directories), so its first calls are paid outside its time as well
        tm.save_pretrained(warm, os.path.join(os.path.dirname(directory), "saved-warm"))
    config = llama_config(**sizes)
    dist.barrier()
    with PeakRSSGrowth() as growth:
        start = time.perf_counter()
        model = _load(side, directory, config)
        loaded = time.perf_counter() - start
        _touch(model)  # in the time too: a lazily mapped shard is read only now
        seconds = time.perf_counter() - start
    out = {"seconds": seconds, "load_seconds": loaded, "rss_growth": growth.bytes}
    if side == "trainmesh zero3":  # the save, from the model just loaded
        target = os.path.join(os.path.dirname(directory), "saved-trainmesh")
        dist.barrier()
        with PeakRSSGrowth() as growth:
            start = time.perf_counter()
            tm.save_pretrained(model, target, max_shard_size=SHARD)
            out["save_seconds"] = time.perf_counter() - start
        out["save_rss_growth"] = growth.bytes
    return out


def _single_read(directory: str) -> float:
    from safetensors.torch import load_file

    start = time.perf_counter()
    total = 0.0
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            total += sum(float(t.float().sum()) for t in load_file(os.path.join(directory, name)).values())
    return time.perf_counter() - start


def _transformers_save(directory: str, target: str) -> float:
    """transformers' save_pretrained on one process, then an fsync of every file and the folder:
    tm.save_pretrained fsyncs its files before publishing them, so both sides pay for durability."""
    import transformers

    from trainmesh.checkpoint.integrity import fsync_path

    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    start = time.perf_counter()
    model.save_pretrained(target, max_shard_size=SHARD)
    for name in os.listdir(target):
        fsync_path(os.path.join(target, name))
    fsync_path(target)
    return time.perf_counter() - start


def _init_worker() -> float:
    """Largest difference, on this process, between each layout's initialisation and one process's."""
    import trainmesh as tm
    from trainmesh._torch.materialize import materialize, prepare
    from trainmesh._torch.names import canonical_name
    from trainmesh._torch.shard_ranges import local_region
    from trainmesh._torch.sync import unwrap

    tm.initialize()
    config = llama_config(128, 4, 256, vocab=1024)
    whole = _meta_model(config)
    materialize(whole, prepare(whole, None, 7), "cpu")
    reference = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}

    def model_parallel(shape, model, axes=("data", "model"), **options):
        mesh = tm.DeviceMesh(shape, list(axes), devices=tm.list_devices())
        return tm.ModelParallel(
            layout_map=tm.LayoutMap.auto(model, mesh, verbose=False), batch_dim_name="data", **options
        )

    layouts = {
        "dp": lambda m: tm.DataParallel(),
        "zero3": lambda m: tm.DataParallel(zero_stage=3),
        "tp2x2": lambda m: model_parallel((2, 2), m),
        "tp1x4": lambda m: model_parallel((1, 4), m),
        "pipe2": lambda m: tm.DataParallel(
            device_mesh=tm.DeviceMesh((2, 2), ["pipe", "data"], devices=tm.list_devices()),
            pipeline=tm.Pipeline(axis="pipe", schedule="1f1b", microbatches=2),
        ),
    }
    worst = 0.0
    for make in layouts.values():
        model = _meta_model(config)
        model = unwrap(make(model).distribute_model(model, init_seed=7))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            local, offsets, shape = local_region(tensor)
            want = reference[canonical_name(name)].detach()[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
            if local.numel():
                worst = max(worst, (local - want).abs().max().item())
    return worst


def _median(values):
    return statistics.median(values) if values else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny model, 1 round: the code path only (the test suite's)"
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick or args.smoke else 2)
    sizes = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import transformers

    from trainmesh.testing import run_distributed

    scratch = tempfile.mkdtemp(dir=args.dir)
    try:
        directory, tiny = os.path.join(scratch, "llama"), os.path.join(scratch, "tiny")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config(**sizes))
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(directory, max_shard_size=SHARD)
        del model
        transformers.LlamaForCausalLM(llama_config(64, 2, 128, vocab=512)).save_pretrained(tiny)
        _single_read(directory)  # the page cache is warm for every side
        sides = ["trainmesh zero3", "transformers fsdp", "trainmesh tp"]
        step_sides = ["trainmesh zero3", "transformers fsdp"]
        extra = ["single read", "copy limit", "transformers save"]
        runs: dict[str, list[dict]] = {s: [] for s in sides + extra + [f"first step {s}" for s in step_sides]}
        for r in range(rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                out = run_distributed(_load_worker, world_size=4, args=(side, directory, tiny, sizes), timeout=900)
                runs[side].append(
                    {
                        "seconds": max(o["seconds"] for o in out),
                        "load_seconds": max(o["load_seconds"] for o in out),
                        "rss": max(o["rss_growth"] for o in out) / full_bytes,
                        **(
                            {
                                "save_seconds": max(o["save_seconds"] for o in out),
                                "save_rss": max(o["save_rss_growth"] for o in out) / full_bytes,
                            }
                            if side == "trainmesh zero3"
                            else {}
                        ),
                    }
                )
                shutil.rmtree(os.path.join(scratch, "saved-trainmesh"), ignore_errors=True)
            for side in step_sides[r % 2 :] + step_sides[: r % 2]:
                out = run_distributed(
                    _first_step_worker, world_size=4, args=(side, directory, tiny, sizes), timeout=900
                )
                slowest = max(out, key=lambda o: o["seconds"])  # its phases: the figure's time, split
                runs[f"first step {side}"].append(
                    {
                        "seconds": slowest["seconds"],
                        "loss": out[0]["loss"],
                        **{k: slowest[k] for k in PHASES + tuple(f"{p}_cpu" for p in PHASES)},
                        "cpu_seconds_per_process": [sum(o[f"{p}_cpu"] for p in PHASES) for o in out],
                    }
                )
            runs["single read"].append({"seconds": _single_read(directory)})
            runs["copy limit"].append({"seconds": _copy_limit(directory)})
            runs["transformers save"].append({"seconds": _transformers_save(directory, os.path.join(scratch, "saved"))})
            shutil.rmtree(os.path.join(scratch, "saved"), ignore_errors=True)
        init_diff = max(run_distributed(_init_worker, world_size=4, timeout=600))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    zero3, tf, tp = runs["trainmesh zero3"], runs["transformers fsdp"], runs["trainmesh tp"]
    first, first_tf = runs["first step trainmesh zero3"], runs["first step transformers fsdp"]
    figures = {
        "hf_time_to_first_step_vs_transformers_distributed": _median(
            [a["seconds"] / b["seconds"] for a, b in zip(first, first_tf)]
        ),
        "hf_load_time_vs_copy_limit": _median(
            [a["load_seconds"] / b["seconds"] for a, b in zip(zero3, runs["copy limit"])]
        ),
        # the same step from the same weights: the two sides' first losses agree (context, not a goal)
        "first_step_loss_abs_diff": _median([abs(a["loss"] - b["loss"]) for a, b in zip(first, first_tf)]),
        "meta_load_peak_rss_vs_full_fp32": _median([r["rss"] for r in zero3]),
        "meta_load_peak_rss_vs_full_fp32_tp": _median([r["rss"] for r in tp]),
        "hf_load_time_vs_transformers_distributed": _median([a["seconds"] / b["seconds"] for a, b in zip(zero3, tf)]),
        "hf_load_time_vs_single_read": _median(
            [a["seconds"] / b["seconds"] for a, b in zip(zero3, runs["single read"])]
        ),
        "save_pretrained_peak_rss_vs_full_fp32": _median([r["save_rss"] for r in zero3]),
        "save_pretrained_time_vs_transformers_save": _median(
            [a["save_seconds"] / b["seconds"] for a, b in zip(zero3, runs["transformers save"])]
        ),
        "meta_init_layout_max_abs_diff": init_diff,
        "transformers_fsdp_load_peak_rss_vs_full_fp32": _median([r["rss"] for r in tf]),  # context: the peer
    }
    print(f"Llama {full_bytes / 1e9:.2f} GB fp32, 4 processes, {rounds} round(s)")
    print(f"{'side':<30}{'seconds (median)':>18}{'peak RSS growth / full':>26}")
    for side, values in runs.items():
        rss = _median([v["rss"] for v in values if "rss" in v])
        print(f"{side:<30}{_median([v['seconds'] for v in values]):>18.2f}{rss:>26.3f}")
        if "ready" in values[0]:  # the first step's split (the slowest process): wall, and CPU seconds
            for phase in PHASES:
                wall, cpu = _median([v[phase] for v in values]), _median([v[f"{phase}_cpu"] for v in values])
                print(f"{'  ' + phase + ' (wall / cpu)':<30}{wall:>18.2f}{cpu:>26.2f}")
    print(
        f"{'trainmesh save':<30}{_median([v['save_seconds'] for v in zero3]):>18.2f}"
        f"{_median([v['save_rss'] for v in zero3]):>26.3f}"
    )
    print()
    for name, value in figures.items():
        print(f"{name:<48}{value:10.4g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "big_model",
                    "quick": args.quick,
                    "rounds": rounds,
                    "full_fp32_bytes": full_bytes,
                    "sizes": sizes,
                    "runs": runs,
                    "figures": figures,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
