"""Fine-tune a local Hugging Face causal LM with LoRA adapters (peft) on any trainmesh layout.

    trainmesh run -n 4 examples/finetune_lora.py --base BASE_DIR --data corpus.txt --out adapters
    trainmesh run -n 4 examples/finetune_lora.py --base BASE_DIR --data shards/ --out adapters --layout tp
    trainmesh run -n 4 examples/finetune_lora.py ... --resume             # continues a killed run
    trainmesh run -n 4 examples/finetune_lora.py ... --merge merged       # also the merged full model

``--base`` is a Hugging Face checkpoint directory (``config.json`` + safetensors, and a tokenizer
when ``--data`` is a text file). The model is built on the meta device and each process reads only
its own shards of the base weights (``weights=``); peft's ``get_peft_model`` adds the adapters, which
alone are trained: the frozen base gets no gradients, no gradient communication and no optimizer
state. ``--data`` is a text file (tokenized with the base's tokenizer) or a token-shard directory
written by ``tm.data.write_token_shards``, read as windows of ``--block`` tokens.

Out: ``--out`` holds peft's adapter format (``adapter_model.safetensors`` + ``adapter_config.json``),
which ``PeftModel.from_pretrained(base_model, OUT)`` loads; ``--merge DIR`` adds the base with the
adapters merged, in the Hugging Face layout. Sharded training checkpoints go to
``--checkpoints`` (default ``OUT-checkpoints``, beside the adapters rather than in them), and
``--resume`` continues from the newest.

Layouts (on N processes): dp (DDP), fsdp (ZeRO-3), tp (LayoutMap.auto on a 1 x N mesh: each adapter
is split beside its base), tp+fsdp (2 x N/2), pp (a pipeline over N processes).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import trainmesh as tm
from trainmesh.demo.corpus import CharWindows

from transformers_lm import build_distribution, lm_loss  # the same layouts and loss as full training

LAYOUTS = ("dp", "fsdp", "tp", "tp+fsdp", "pp")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_lora_model(base: str, args: argparse.Namespace) -> torch.nn.Module:
    """The base's architecture on the meta device, wrapped by peft: nothing is allocated yet."""
    import peft
    import transformers

    config = transformers.AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.base_dtype])
        targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
        lora = peft.LoraConfig(
            r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout, target_modules=targets, task_type="CAUSAL_LM"
        )
        return peft.get_peft_model(model, lora)  # adapters stay fp32 over a bf16 base (peft's autocast_adapter_dtype)


def token_windows(path: str, base: str, block: int, vocab_size: int) -> torch.utils.data.Dataset:
    if os.path.isdir(path):
        dataset = tm.data.TokenShardDataset(path, block_size=block, shuffle=False)
        if dataset.index["vocab_size"] > vocab_size:
            raise SystemExit(
                f"--data {path}: its tokens go up to {dataset.index['vocab_size']}; the base's "
                f"vocabulary has {vocab_size} entries"
            )
        return dataset
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    except (OSError, ValueError) as exc:
        raise SystemExit(
            f"--data {path} is a text file, and --base {base} has no tokenizer to read it ({exc}). "
            f"Pass a token-shard directory (tm.data.write_token_shards) instead."
        ) from None
    with open(path, encoding="utf-8") as f:
        ids = torch.tensor(tokenizer(f.read())["input_ids"], dtype=torch.long)
    return CharWindows(ids, block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, metavar="DIR", help="a local Hugging Face checkpoint directory")
    parser.add_argument("--data", required=True, metavar="PATH", help="a text file or a token-shard directory")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the trained adapters are written")
    parser.add_argument("--merge", metavar="DIR", help="also write the base with the adapters merged")
    parser.add_argument("--layout", choices=LAYOUTS, default="fsdp")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    parser.add_argument("--alpha", type=float, default=32, help="LoRA alpha (scaling alpha / r)")
    parser.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout")
    parser.add_argument("--targets", default="all-linear", help="comma-separated module names, or all-linear")
    parser.add_argument(
        "--base-dtype",
        choices=tuple(DTYPES),
        default="fp32",
        help="the frozen base's dtype (bf16: adapters train in fp32 with bf16-mixed compute)",
    )
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per epoch (at most the data)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--block", type=int, default=256, help="sequence length (tokens)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--checkpoints", metavar="DIR", help="sharded training checkpoints (default OUT-checkpoints)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()
    tm.initialize()

    model = build_lora_model(args.base, args)
    data = token_windows(args.data, args.base, args.block, model.config.vocab_size)
    subset = torch.utils.data.Subset(data, range(min(len(data), args.steps * args.batch_size)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    checkpoints = args.checkpoints or os.path.normpath(args.out) + "-checkpoints"
    trainer = tm.Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=args.lr),
        lm_loss,
        distribution=build_distribution(args.layout, model),
        weights=args.base,
        max_grad_norm=1.0,
        precision="bf16-mixed" if args.base_dtype == "bf16" else "fp32",
        callbacks=[tm.ShardedCheckpoint(checkpoints)],
    )
    start = time.perf_counter()
    history = trainer.fit(subset, epochs=args.epochs, batch_size=args.batch_size, resume=args.resume)
    seconds = time.perf_counter() - start
    tm.save_pretrained(trainer.model, args.out)  # collective: every process takes part
    if args.merge:
        tm.save_pretrained(trainer.model, args.merge, merge_adapters=True)
    if tm.is_main_process():
        loss = history.steps[-1]["loss"] if history.steps else float("nan")
        print(
            f"LoRA r={args.rank} on {args.layout} x {tm.world_size()} processes: {trainable:,} of {total:,} "
            f"parameters trained, {len(history.steps)} steps in {seconds:.1f} s, final loss {loss:.6f}; "
            f"adapters in {args.out}" + (f", merged model in {args.merge}" if args.merge else "")
        )
    tm.shutdown()


if __name__ == "__main__":
    main()
