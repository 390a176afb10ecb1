"""Long sequences: context parallelism (ring, Ulysses) and sequence parallelism beside TP, on 4 gloo processes.

    python benchmarks/long_context.py [--quick] [--seq N] [--rounds R] [--json PATH]

One launch of 4 processes (one thread each) with a transformers Llama of about 26M parameters (``--quick``:
a 2-layer one) measures:

* ``cp_saved_activations_vs_single``: activation bytes autograd saves for backward per process
  (``saved_tensors_hooks``, each storage once, parameters excluded) at seq 4, over one process on the
  same sequence; both methods, the larger ratio reported;
* ``cp_longest_seq_vs_single``: the longest sequence whose saved activations fit a fixed per-process
  budget (what one process saves at ``--seq``), seq 4 over one process. The budget is on the counted
  activation bytes, not RLIMIT_AS or a cgroup: the saved bytes are measured at two lengths per
  layout and the longest fitting length is read off that line (they grow linearly: causal attention's
  kernels keep no S x S matrix);
* ``cp_parity_max_abs_diff``: the largest parameter difference from one process after 3 AdamW steps
  on a tiny Llama, ring and Ulysses at seq 4 (the tests' model and settings);
* ``sp_activations_vs_tp``: saved bytes per process with sequence parallelism over plain TP, data 2 x
  model 2;
* ``ring_vs_ulysses_step``: training step time, ring over Ulysses at seq 4, in interleaved rounds
  (the order alternates, ``trainer_overhead.round_order``) after an untimed epoch each; each step is
  timed on its own (the Trainer's ``step_time_s``) and a round is the mean after its first step; the
  median ratio and its spread;
* ``cp_step_vs_deepspeed_ulysses`` (where deepspeed is importable): trainmesh's Ulysses step over DeepSpeed's Ulysses
  for HF models (ALST, ``ds_ulysses.py``) on the same model, sequence, batch and AdamW, in the same
  interleaved rounds: the slowest rank's step, median of the per-round ratios, withheld unless both first-step
  losses are within ``LOSS_TOLERANCE`` of one process; otherwise ``null`` with the reason under ``skipped``.

Absolute times on a shared CPU are noise; the load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "multiprocess"))
sys.path.insert(0, HERE)


def _model(cfg):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["ffn"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=1 << 17,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).float()


def _tokens(cfg, seq, rows, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, cfg["vocab"], (rows, seq + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _job(cfg) -> dict:
    import torch

    import trainmesh as tm
    from cp_cases import lm_loss, make_optimizer
    from test_context_parallel import _saved_bytes, _train
    from trainmesh.distribution.sequence_split import SequenceSplit
    from trainmesh.trainer.callbacks import LambdaCallback
    from trainer_overhead import round_order

    rank = torch.distributed.get_rank()
    out: dict = {"saved": {}, "steps": {"ring": [], "ulysses": []}, "parity": {}, "first_loss": {}}
    seq_mesh = tm.DeviceMesh((4,), ["seq"], devices=tm.list_devices())
    split = SequenceSplit(axis="seq", axis_size=4)
    trainers = {}
    timer = {"times": []}  # each training step's own time, into the round's list (below)
    step_times = LambdaCallback(on_train_batch_end=lambda step, logs: timer["times"].append(logs["step_time_s"]))
    for method in ("ring", "ulysses"):
        distribution = tm.DataParallel(seq_mesh, sequence_dim_name="seq", context_parallel=method)
        trainers[method] = tm.Trainer(
            _model(cfg),
            make_optimizer,
            lm_loss,
            distribution=distribution,
            progress=False,
            nonfinite_loss=None,
            callbacks=[step_times],
        )
    # saved bytes per process at two lengths (for the budget line), and one process's at the same lengths
    for seq in (cfg["seq"] // 2, cfg["seq"]):
        x, y = _tokens(cfg, seq, cfg["batch"])
        local = split.split_batch((x, y), split.index_of(seq_mesh))
        for method, trainer in trainers.items():
            trainer.model.train()
            out["saved"][(method, seq)] = _saved_bytes(trainer.model, *local)
        if rank == 0:
            out["saved"][("single", seq)] = _saved_bytes(_model(cfg), x, y)
    # step times, interleaved rounds, after one untimed epoch each; each round is the next epoch (fit
    # trains up to ``epochs`` in all)
    x, y = _tokens(cfg, cfg["seq"], cfg["batch"] * cfg["steps"])
    first = (x[: cfg["batch"]], y[: cfg["batch"]])
    peer = _deepspeed_side(cfg, out) if cfg.get("deepspeed") else None
    methods = ("ring", "ulysses") + (("deepspeed",) if peer else ())
    # the first batch's loss at the initial weights, each side and one process (same seed, same batch)
    if peer:
        out["first_loss"]["ulysses"] = trainers["ulysses"].evaluate(first, batch_size=cfg["batch"])["loss"]
        if rank == 0:
            out["first_loss"]["single"] = lm_loss(_model(cfg)(first[0]), first[1]).item()
    # A round's figure is the mean step time after its first step, each step timed on its own: the Trainer's
    # own ``step_time_s`` (batch fetch, split, forward, backward, all-reduce, AdamW) and, for DeepSpeed, the
    # same span around ``step`` (slice, forward, backward, all-reduce, AdamW). A round's first step and
    # ``fit``'s per-call set-up are left out on both sides: with a few steps a round they would swamp the
    # step (fit starts its loader and prints its plan once per call).
    for r in range(-1, cfg["rounds"]):
        for method in round_order(methods, max(r, 0)):
            times = []
            if method == "deepspeed":
                for i in range(cfg["steps"]):
                    rows = slice(i * cfg["batch"], (i + 1) * cfg["batch"])
                    started = time.perf_counter()
                    loss = peer.step(x[rows], y[rows])
                    times.append(time.perf_counter() - started)
                    out["first_loss"].setdefault("deepspeed", loss)
            else:
                trainer = trainers[method]
                timer["times"] = times
                trainer.fit((x, y), epochs=trainer.epoch + 1, batch_size=cfg["batch"], shuffle=False)
            if r >= 0:
                out["steps"][method].append(statistics.mean(times[1:]))
    del peer
    del trainers
    # parity on the tests' tiny Llama
    from cp_cases import data

    from cp_cases import build_model

    for method in ("ring", "ulysses"):
        distribution = tm.DataParallel(seq_mesh, sequence_dim_name="seq", context_parallel=method)
        out["parity"][method] = _train(build_model(), distribution, data())[0]
    out["saved"].update(_sp_job(cfg)["saved"])
    return out


def _deepspeed_side(cfg, out: dict):
    """DeepSpeed's Ulysses on the same model, sequence, batch and optimizer (``ds_ulysses``), or None with the
    reason under ``out["deepspeed_error"]`` (DeepSpeed missing, or failing on CPU/gloo: the error and where)."""
    import traceback

    try:
        from cp_cases import make_optimizer
        from ds_ulysses import DeepSpeedUlysses

        out["steps"]["deepspeed"] = []
        return DeepSpeedUlysses(_model(cfg), make_optimizer, seq=cfg["seq"], batch=cfg["batch"])
    except Exception as error:  # every rank fails alike (same model, same checks) before a collective
        where = traceback.extract_tb(error.__traceback__)[-1]
        out["deepspeed_error"] = (
            f"{type(error).__name__}: {error} (at {os.path.basename(where.filename)}:{where.lineno})"
        )
        return None


def _sp_job(cfg) -> dict:
    """Sequence parallelism vs plain TP at data 2 x model 2, each with the loss on whole logits (``lm_loss``)
    and on the head's vocabulary shards (``trainmesh.losses.lm_cross_entropy``): saved bytes per process."""
    import trainmesh as tm
    from cp_cases import make_optimizer
    from test_vocab_parallel_loss import _saved_bytes as saved_with
    from trainmesh.losses import lm_cross_entropy

    from cp_cases import lm_loss

    saved = {}
    mesh = tm.DeviceMesh((2, 2), ["data", "model"], devices=tm.list_devices())
    x, y = _tokens(cfg, cfg["seq"], cfg["batch"])
    for sp in (False, True):
        model = _model(cfg)
        distribution = tm.ModelParallel(
            layout_map=tm.LayoutMap.auto(model, mesh, verbose=False), batch_dim_name="data", sequence_parallel=sp
        )
        trainer = tm.Trainer(model, make_optimizer, lm_cross_entropy, distribution=distribution, progress=False)
        trainer.model.train()
        rows = slice(0, cfg["batch"] // 2) if distribution.data_index() == 0 else slice(cfg["batch"] // 2, None)
        name = "sp" if sp else "tp"
        saved[(name, cfg["seq"])] = saved_with(trainer.model, x[rows], y[rows], lm_loss, sharded=False)
        saved[(f"{name}+vocab", cfg["seq"])] = saved_with(
            trainer.model, x[rows], y[rows], lm_cross_entropy, sharded=True
        )
    return {"saved": saved}


def _longest(saved: dict, key: str, lengths: tuple[int, int], budget: float) -> float:
    """The length at which the line through the two measured (length, bytes) points reaches ``budget``."""
    (a, b) = lengths
    slope = (saved[(key, b)] - saved[(key, a)]) / (b - a)
    return b + (budget - saved[(key, b)]) / slope


def _sp_ratios(results: list, seq: int) -> dict:
    """Saved bytes per process (the larger process's), sequence parallelism over plain TP: with the same loss
    on both sides (whole logits, or the vocabulary shards: the figure), and SP with the shards over TP
    without."""

    def per_process(key):
        return max(r["saved"][(key, seq)] for r in results)

    return {
        "sp / tp": per_process("sp") / per_process("tp"),
        "sp+vocab / tp+vocab": per_process("sp+vocab") / per_process("tp+vocab"),
        "sp+vocab / tp": per_process("sp+vocab") / per_process("tp"),
    }


def _sp_main(cfg: dict, params: int, json_path: str | None) -> int:
    from trainmesh.testing import run_distributed

    load_before = os.getloadavg()[0]
    results = run_distributed(_sp_job, world_size=4, args=(cfg,), timeout=900)
    load_after = os.getloadavg()[0]
    ratios = _sp_ratios(results, cfg["seq"])
    print(
        f"Llama {params / 1e6:.1f}M parameters, seq {cfg['seq']}, data 2 x model 2, "
        f"load {load_before:.1f} -> {load_after:.1f}"
    )
    print(f"{'saved bytes per process':24} {'ratio':>8}")
    for name, value in ratios.items():
        print(f"{name:24} {value:8.3f}")
    print(f"sp_activations_vs_tp (sp+vocab / tp+vocab) {ratios['sp+vocab / tp+vocab']:.3f}  goal <= 0.65")
    if json_path:
        report = {
            "config": cfg,
            "figures": {"sp_activations_vs_tp": ratios["sp+vocab / tp+vocab"]},
            "sp_ratios": ratios,
            "saved_bytes": {f"{k[0]}@{k[1]}": v for k, v in results[0]["saved"].items()},
            "load_avg_1min": {"before": load_before, "after": load_after},
        }
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


LOSS_TOLERANCE = 1e-5  # fp32 cross-entropy near log(vocab): summation order moves it by ~1e-6


def _deepspeed_figure(results: list, skipped: dict):
    """trainmesh's Ulysses step over DeepSpeed's, the slowest rank's time each round, median of the per-round
    ratios; withheld (with the reason) where DeepSpeed did not run or the first-step losses disagree."""
    first = results[0]
    if "deepspeed" not in first["steps"] and "deepspeed_error" not in first:
        skipped["cp_step_vs_deepspeed_ulysses"] = (
            "DeepSpeed's Ulysses (ALST, benchmarks/ds_ulysses.py) was not run: deepspeed is not importable "
            "(pip install deepspeed) or --no-deepspeed was given"
        )
        return None, [], first["first_loss"]
    if "deepspeed_error" in first:
        skipped["cp_step_vs_deepspeed_ulysses"] = f"DeepSpeed's Ulysses did not start: {first['deepspeed_error']}"
        return None, [], first["first_loss"]
    slowest = {
        m: [max(r["steps"][m][i] for r in results) for i in range(len(first["steps"][m]))] for m in first["steps"]
    }
    ratios = [a / b for a, b in zip(slowest["ulysses"], slowest["deepspeed"])]
    losses = first["first_loss"]
    gap = max(abs(losses[m] - losses["single"]) for m in ("ulysses", "deepspeed"))
    losses = {**losses, "max_abs_diff_from_single": gap, "tolerance": LOSS_TOLERANCE}
    if gap > LOSS_TOLERANCE:
        skipped["cp_step_vs_deepspeed_ulysses"] = f"first-step losses differ by {gap:.3g} > {LOSS_TOLERANCE}: {losses}"
        return None, ratios, losses
    return statistics.median(ratios), ratios, losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and sequence (a smoke run)")
    parser.add_argument("--seq", type=int, help="sequence length (default 1024; --quick 256)")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (default 3; --quick 2)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--deepspeed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time DeepSpeed's Ulysses beside trainmesh's (cp_step_vs_deepspeed_ulysses); default: when "
        "deepspeed is importable",
    )
    parser.add_argument("--sp-only", action="store_true", help="only the sequence-parallelism figure")
    args = parser.parse_args(argv)
    if args.quick:
        cfg = dict(vocab=2048, hidden=128, ffn=352, layers=2, heads=8, kv_heads=4, seq=256, batch=2, steps=4, rounds=2)
    else:
        cfg = dict(
            vocab=8192, hidden=512, ffn=1408, layers=6, heads=8, kv_heads=4, seq=1024, batch=2, steps=4, rounds=3
        )
    cfg["seq"] = args.seq or cfg["seq"]
    cfg["rounds"] = args.rounds or cfg["rounds"]
    # DeepSpeed is an optional peer ('.[bench]'): run where importable unless --no-deepspeed
    cfg["deepspeed"] = (
        args.deepspeed if args.deepspeed is not None else importlib.util.find_spec("deepspeed") is not None
    )
    import torch

    from cp_cases import build_model, data, reference
    from trainmesh.testing import run_distributed

    params = sum(p.numel() for p in _model(cfg).parameters())
    if args.sp_only:
        return _sp_main(cfg, params, args.json)
    load_before = os.getloadavg()[0]
    results = run_distributed(_job, world_size=4, args=(cfg,), timeout=3000 if not args.quick else 900)
    load_after = os.getloadavg()[0]
    first = results[0]
    saved = first["saved"]
    seq, half = cfg["seq"], cfg["seq"] // 2
    saved_ratio = max(max(r["saved"][(m, seq)] for r in results) / saved[("single", seq)] for m in ("ring", "ulysses"))
    budget = saved[("single", seq)]
    per_process = {k: max(r["saved"][k] for r in results) for k in saved if k[0] in ("ring", "ulysses")}
    longest = min(_longest(per_process, m, (half, seq), budget) for m in ("ring", "ulysses")) / seq
    expected, _ = reference(build_model(), *data())
    parity = max(
        max((first["parity"][m][k] - expected[k]).abs().max().item() for k in expected) for m in ("ring", "ulysses")
    )
    sp_ratios = _sp_ratios(results, seq)
    sp_ratio = sp_ratios["sp+vocab / tp+vocab"]
    ring, ulysses = first["steps"]["ring"], first["steps"]["ulysses"]
    ratios = [a / b for a, b in zip(ring, ulysses)]
    skipped = {}
    ds_figure, ds_ratios, ds_loss = _deepspeed_figure(results, skipped)
    figures = {
        "cp_saved_activations_vs_single": saved_ratio,
        "cp_longest_seq_vs_single": longest,
        "cp_parity_max_abs_diff": parity,
        "sp_activations_vs_tp": sp_ratio,
        "cp_step_vs_deepspeed_ulysses": ds_figure,
        "ring_vs_ulysses_step": statistics.median(ratios),
    }
    report = {
        "config": cfg,
        "parameters": params,
        "world_size": 4,
        "quick": args.quick,
        "figures": figures,
        "skipped": skipped,
        "load_avg_1min": {"before": load_before, "after": load_after},
        "step_s": {"ring": ring, "ulysses": ulysses},
        "ring_over_ulysses_per_round": ratios,
        "ulysses_over_deepspeed_per_round": ds_ratios,
        "first_step_loss": ds_loss,
        "saved_bytes": {f"{k[0]}@{k[1]}": v for k, v in saved.items()},
        "sp_ratios": sp_ratios,
        "torch": torch.__version__,
    }
    targets = {
        "cp_saved_activations_vs_single": "<= 0.30",
        "cp_longest_seq_vs_single": ">= 3.5",
        "cp_parity_max_abs_diff": "<= 1e-6",
        "sp_activations_vs_tp": "<= 0.65",
        "cp_step_vs_deepspeed_ulysses": "<= 1.0",
        "ring_vs_ulysses_step": "reported",
    }
    print(
        f"Llama {params / 1e6:.1f}M parameters, seq {seq}, 4 gloo processes, load {load_before:.1f} -> {load_after:.1f}"
    )
    print(f"{'figure':34} {'value':>12}  goal")
    for name, value in figures.items():
        shown = "n/a" if value is None else (f"{value:.3g}" if abs(value) < 1e-3 else f"{value:.3f}")
        print(f"{name:34} {shown:>12}  {targets[name]}")
    print(
        f"ring / ulysses step per round: {', '.join(f'{r:.2f}' for r in ratios)} "
        f"(spread {min(ratios):.2f}-{max(ratios):.2f})"
    )
    if ds_ratios:
        print(
            f"trainmesh ulysses / deepspeed ulysses step per round (slowest rank): "
            f"{', '.join(f'{r:.2f}' for r in ds_ratios)}; first-step loss {ds_loss}"
        )
    for name, reason in skipped.items():
        print(f"{name}: {reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
