"""The demo's per-process training program: ``python -m trainmesh.demo.job [--out DIR] [--quick]``.

``trainmesh demo`` starts it on N local processes (through ``trainmesh run``); it also runs as
one plain process. Every process builds the same corpus and the same initial model (same
seed), the Trainer splits each global batch over them (DataParallel), and the main process
then writes the loss curve, samples some text and prints where everything went.

Outputs under ``--out``: ``checkpoints/{last,best}.pt`` (Trainer state dicts), ``logs/``
(``steps.jsonl``/``epochs.jsonl`` and CSVs), ``loss_curve.png``, ``sample.txt`` and
``demo.json`` (vocabulary, model config, settings and per-epoch losses: what is needed to
load the checkpoint and sample again without the corpus).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

import trainmesh as tm

from .char_gpt import CharGPT, GPTConfig, lm_loss
from .corpus import build_corpus
from .generate import generate


@dataclass(frozen=True)
class DemoSettings:
    """Everything that sizes the run. ``full()`` takes 1-1.5 minutes on 4 processes on 2 CPU cores with a
    native bf16 matmul (measured: 1.660 in 81 s, launch included, load 6-8 from other jobs) and ~2.5
    minutes in fp32 on 2 AVX2-only cores (1.662 in 157 s, launch included, load 2-4); it reaches a
    held-out loss of ~1.66 nats/char either way.

    The shape is chosen for the CPU: 2 blocks of width 192 with 3 heads of 64 and one micro-batch of 32
    windows per process per step. Against the earlier width 128 (4 heads of 32, two micro-batches of
    16) it does 2.2x the FLOPs per sample at 1.5x the step time (wider matmuls and 64-wide heads keep
    the vector units busier; one larger micro-batch halves the per-micro-batch overhead), so in about
    the same time it reaches a lower held-out loss (1.66 vs 1.82 nats/char)."""

    char_budget: int = 1_200_000
    max_file_chars: int = 50_000  # per module, so that many modules contribute
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 3
    d_model: int = 192
    epochs: int = 2
    global_batch_size: int = 128  # windows per optimizer step, over all processes
    grad_accum_steps: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    sample_chars: int = 300
    prompt: str = "def "
    temperature: float = 0.8
    top_k: int = 20
    seed: int = 0
    # "bf16-mixed" where this machine's bf16 matmuls are fast (AMX, AVX512-BF16, GPUs), else "fp32":
    # the launcher decides once for every worker (trainer/precision.py fastest_precision).
    precision: str = "bf16-mixed"

    @classmethod
    def full(cls) -> "DemoSettings":
        return cls()

    @classmethod
    def quick(cls) -> "DemoSettings":
        """Seconds instead of minutes, for tests: same code path, tiny corpus and model."""
        # Small batches: enough optimizer steps (~220) to learn more than character frequencies,
        # which the test checks (a held-out loss well below the unigram model's).
        return cls(
            char_budget=60_000,
            max_file_chars=5_000,
            block_size=32,
            n_layer=1,
            n_head=4,
            d_model=64,
            epochs=2,
            global_batch_size=16,
            grad_accum_steps=2,
            sample_chars=60,
        )  # accumulation exercised

    def global_batch_for(self, world_size: int) -> int:
        """The global batch rounded up to a multiple of accumulation x processes (the Trainer needs
        equal micro-batches); with 1, 2, 4 or 8 processes it is exactly ``global_batch_size``."""
        per_step = self.grad_accum_steps * world_size
        return math.ceil(self.global_batch_size / per_step) * per_step


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainmesh.demo.job", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="trainmesh-demo", help="output directory (default: ./trainmesh-demo)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs (default: 2)")
    parser.add_argument("--quick", action="store_true", help="a tiny run that takes seconds (for tests)")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16-mixed"),
        default=None,
        help="compute precision (default: bf16-mixed; `trainmesh demo` picks the faster one here)",
    )
    args = parser.parse_args(argv)
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs must be >= 1. Received: {args.epochs}")
    return args


def build_optimizer(model: torch.nn.Module, settings: DemoSettings) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: decaying LayerNorm gains and biases toward 0 only hurts."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95))


PLOT_INSTALL_HINT = "pip install -e '.[demo]'  (or: pip install matplotlib)"


def draw_curves(log_dir: Path, png: Path) -> str | None:
    """Write the loss curve with ``trainmesh plot``'s matplotlib figure (Agg, off-screen).

    Returns ``"matplotlib"``, or None when matplotlib is not installed: the run itself succeeded,
    so a missing plotting library costs the figure only, with a message saying how to get it.
    """
    from trainmesh.launcher import plot
    from trainmesh.trainer.log_writer import read_log

    try:
        plot.draw(
            read_log(log_dir, "steps"),
            read_log(log_dir, "epochs"),
            png,
            title="trainmesh demo: character GPT on the Python standard library",
        )
    except ImportError as exc:
        print(
            f"[demo] {png.name} not written: the loss curve needs matplotlib ({exc}). Install it with: "
            f"{PLOT_INSTALL_HINT}; then `trainmesh plot {log_dir}` draws it from the logs.",
            file=sys.stderr,
            flush=True,
        )
        return None
    return "matplotlib"


def _token_shard_datasets(out: Path, corpus, settings: DemoSettings):
    """The corpus as token shards on disk (written once, by the main process) read back memory-mapped:
    the same windows as ``corpus.datasets`` while each text fits one shard (1 << 22 tokens)."""
    from trainmesh.data import TokenShardDataset, write_char_shards

    dirs = {"train": out / "shards" / "train", "heldout": out / "shards" / "heldout"}
    if tm.is_main_process():
        for name, text in (("train", corpus.train_text), ("heldout", corpus.heldout_text)):
            write_char_shards(text, dirs[name], corpus.vocab, shard_tokens=1 << 22, overwrite=True)
    tm.barrier()
    return tuple(
        TokenShardDataset(dirs[name], block_size=settings.block_size, seed=settings.seed)
        for name in ("train", "heldout")
    )


def model_config(corpus, settings: DemoSettings) -> GPTConfig:
    """The demo's CharGPT shape: its settings over the corpus's vocabulary (benchmarks/dataloader.py
    builds the same model to time the demo's step)."""
    return GPTConfig(
        vocab_size=len(corpus.vocab),
        block_size=settings.block_size,
        n_layer=settings.n_layer,
        n_head=settings.n_head,
        d_model=settings.d_model,
    )


def train(out: Path, settings: DemoSettings) -> dict[str, Any]:
    """Run the whole job on this process (collectives with the others); the summary on every process."""
    started = time.perf_counter()
    tm.initialize()
    corpus = build_corpus(settings.char_budget, max_file_chars=settings.max_file_chars)
    train_ds, heldout_ds = _token_shard_datasets(out, corpus, settings)
    config = model_config(corpus, settings)
    # The same seed on every process gives the same initial weights (DDP would broadcast rank 0's
    # anyway; equal seeds also keep dropout-free runs reproducible from 1 to N processes).
    torch.manual_seed(settings.seed)
    model = CharGPT(config)
    global_batch = settings.global_batch_for(tm.world_size())
    total_steps = (len(train_ds) // global_batch) * settings.epochs  # drop_remainder: full batches only
    warmup = max(1, round(settings.warmup_fraction * total_steps))
    scheduler = functools.partial(
        tm.warmup_cosine, warmup_steps=warmup, total_steps=max(total_steps, warmup), min_lr_ratio=settings.min_lr_ratio
    )
    if tm.is_main_process():
        print(
            f"[demo] corpus: {len(corpus.train_text):,} training + {len(corpus.heldout_text):,} held-out characters "
            f"from {len(corpus.train_files) + len(corpus.heldout_files)} standard-library modules; "
            f"vocabulary {len(corpus.vocab)}; model {model.num_parameters():,} parameters; "
            f"{tm.world_size()} process(es)",
            flush=True,
        )
    trainer = tm.Trainer(
        model,
        build_optimizer(model, settings),
        lm_loss,
        distribution=tm.DataParallel(),
        precision=settings.precision,
        # torch's fused AdamW kernel: ~4x faster per optimizer step than the CPU default (for-loop).
        # compile stays off: compiling the blocks makes this model's step ~0.86x eager
        # (benchmarks/throughput.py), ~7 s off this run's ~50 s of steps, while compiling costs
        # 9-40 s on 2 cores with a warm inductor cache and more on a first run: slower end to end.
        optimizer_implementation="fused",
        grad_accum_steps=settings.grad_accum_steps,
        max_grad_norm=1.0,
        scheduler=scheduler,
        log_dir=out / "logs",
        seed=settings.seed,
        # Full global batches only: every step weighs the same, and no "remainder dropped"
        # warning from every process.
        drop_remainder=True,
        callbacks=[tm.ModelCheckpoint(out / "checkpoints", monitor="val_loss")],
    )
    history = trainer.fit(train_ds, epochs=settings.epochs, batch_size=global_batch, eval_data=heldout_ds)
    summary: dict[str, Any] = {
        "train_loss": history.history["loss"],
        "heldout_loss": history.history.get("val_loss", []),
        "train_seconds": round(time.perf_counter() - started, 1),
        "processes": tm.world_size(),
        "global_batch_size": global_batch,
        "optimizer_steps": trainer.global_step,
    }
    if trainer.is_main_process:
        sample = generate(
            trainer.unwrapped_model,
            corpus.vocab,
            settings.prompt,
            settings.sample_chars,
            temperature=settings.temperature,
            top_k=settings.top_k,
            seed=settings.seed,
        )
        summary["sample"] = sample
        summary["plot"] = draw_curves(out / "logs", out / "loss_curve.png")
        (out / "sample.txt").write_text(sample + "\n", encoding="utf-8")
        # Relative names only: the output directory may be moved or shared between machines.
        (out / "demo.json").write_text(
            json.dumps(
                {
                    "model_config": config.to_dict(),
                    "vocab_chars": corpus.vocab.chars,
                    "settings": asdict(settings),
                    "train_files": list(corpus.train_files),
                    "heldout_files": list(corpus.heldout_files),
                    "checkpoints": ["checkpoints/last.pt", "checkpoints/best.pt"],
                    **{k: v for k, v in summary.items() if k != "sample"},
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
    return summary


def report(out: Path, summary: dict[str, Any], settings: DemoSettings) -> str:
    """The closing message: per-epoch losses, where the outputs are, and the sample."""
    losses = "  ".join(f"epoch {i + 1}: {v:.3f}" for i, v in enumerate(summary["heldout_loss"]))
    lines = [
        "",
        f"[demo] done in {summary['train_seconds']}s on {summary['processes']} process(es), "
        f"{summary['optimizer_steps']} optimizer steps of {summary['global_batch_size']} windows",
        f"[demo] held-out loss (nats/char): {losses}",
        f"[demo] outputs in {out.resolve()}",
        "         checkpoints/last.pt, checkpoints/best.pt    Trainer state (model, optimizer, scheduler)",
        "         logs/steps.jsonl, logs/epochs.jsonl (+csv)  per-step and per-epoch records",
        "         loss_curve.png                              loss per step, held-out loss per epoch"
        + ("" if summary.get("plot") else "  (NOT written: matplotlib missing)"),
        "         demo.json, sample.txt                       vocabulary, model config, losses; the sample",
        f"[demo] sample (prompt {settings.prompt!r}, temperature {settings.temperature}, top-k {settings.top_k}):",
        "-" * 72,
        summary["sample"],
        "-" * 72,
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = DemoSettings.quick() if args.quick else DemoSettings.full()
    if args.epochs is not None:
        settings = replace(settings, epochs=args.epochs)
    if args.precision is not None:
        settings = replace(settings, precision=args.precision)
    out = Path(args.out)
    try:
        summary = train(out, settings)
        if tm.is_main_process():
            text = report(out, summary, settings)
            # A sampled character the console cannot encode must not fail a finished run.
            encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
            print(text.encode(encoding, errors="replace").decode(encoding), flush=True)
    finally:
        tm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
