"""Train an unmodified transformers language model (built from a config, no download) with trainmesh.

    trainmesh run -n 4 examples/transformers_lm.py --model llama --layout tp+fsdp --steps 20
    trainmesh run -n 4 examples/transformers_lm.py --model llama --layout dp --resume --epochs 2  # continues it
    trainmesh run -n 2 examples/transformers_lm.py --model gpt2 --layout pp --schedule zbv  # 2 stages per process
    trainmesh run -n 4 examples/transformers_lm.py --layout fsdp --save-pretrained hf-out     # Hugging Face layout
    trainmesh run -n 4 examples/transformers_lm.py --layout tp --init-from hf-out            # fine-tune from it
    trainmesh run -n 4 examples/transformers_lm.py --model qwen3_moe --layout ep             # experts over 4
    trainmesh run -n 4 examples/transformers_lm.py --layout cp --context-parallel ulysses --block 256  # long context
    trainmesh run -n 4 examples/transformers_lm.py --layout cp+tp --context-parallel ring --block 256  # seq 2 x model 2
    trainmesh run -n 4 --replica-groups 2 examples/transformers_lm.py --layout fsdp --replica-groups 2  # torchft

``--init-from DIR`` fine-tunes a local Hugging Face checkpoint (``config.json`` + safetensors): the
model is built on the meta device from DIR's config and each process reads only its own shards of
the weights (``weights=DIR``). ``--save-pretrained OUT`` writes the trained model in the Hugging Face
layout (``tm.save_pretrained``), which ``AutoModelForCausalLM.from_pretrained(OUT)`` loads.

Layouts, on N processes:
  dp       DataParallel (DDP)                    every process holds the whole model
  fsdp     DataParallel(zero_stage=3) (FSDP2)    parameters, gradients and optimizer state sharded
  tp       ModelParallel on a 1 x N mesh         LayoutMap.auto: the model's own plan (Llama) or a
                                                 derived one (GPT-2's Conv1D), printed at start
  tp+fsdp  ModelParallel on a 2 x N/2 mesh, ZeRO-3 over "data"
  pp       a pipeline over N processes (pipe N x data 1), --schedule, --microbatches
  3d       pipe 2 x data N/4 x model 2: a pipeline whose stages are laid out over "model" (N divisible by 4)
  ep       ModelParallel on an N mesh "data", LayoutMap.auto(expert_axis="data"): a mixture of experts'
           (--model qwen3_moe|mixtral, 8 experts) experts split over the processes, tokens sent by all-to-all
  ep+fsdp  ep with ZeRO-3 over "data" for the dense layers
  ep+tp    N/2 x 2 mesh: experts over "data", attention tensor-parallel over "model"
  cp       DataParallel on a N/2 x 2 mesh "data" x "seq": every sequence split over "seq" (context
           parallelism, --context-parallel ring|ulysses|auto; --block divisible by 4)
  cp+fsdp  cp with ZeRO-3 over "data" x "seq"
  sp       tp with sequence parallelism: norms and residual stream split over the sequence on "model"

``--replica-groups G`` trains as one of G torchft replica groups (``tm.ReplicaGroups``; the ``ft`` extra),
each group running ``--layout`` on its own processes: started by ``trainmesh run -n N --replica-groups G``
(which starts the Lighthouse), a group that dies is left behind and the others go on without a restart;
it heals from them when it comes back. The printed loss is each group's own rows'.

The loss function is the same under every layout: it reads ``outputs.logits`` of the model's own
output, which a pipeline's last stage rebuilds around its logits.

The text is the Python standard library's own sources, character-level (as the demo). Each run
prints its loss and tokens/s and saves a sharded checkpoint (DCP) that any layout resumes.
"""

from __future__ import annotations

import argparse
import os
import time
import urllib.parse

import torch

import trainmesh as tm
from trainmesh.demo.corpus import CharVocab, CharWindows, read_sources, select_sources, stdlib_dir

LAYOUTS = ("dp", "fsdp", "tp", "tp+fsdp", "pp", "3d", "ep", "ep+fsdp", "ep+tp", "cp", "cp+fsdp", "cp+tp", "sp")
MODELS = ("gpt2", "llama", "qwen3_moe", "mixtral")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv")


def replica_groups(groups: int | None, parser: argparse.ArgumentParser):
    """``tm.ReplicaGroups`` for ``--replica-groups G``, checked against what the launcher started, before
    any process group exists; None without the flag."""
    if groups is None:
        return None
    launched = os.environ.get("TRAINMESH_REPLICA_GROUPS")
    if os.environ.get("TRAINMESH_REPLICA_GROUP") is None or (launched is not None and int(launched) != groups):
        parser.error(
            f"--replica-groups {groups} needs the launcher's replica groups: trainmesh run -n N --replica-groups "
            f"{groups} examples/transformers_lm.py ... (the launcher started {launched or 'none'})"
        )
    lighthouse = urllib.parse.urlparse(os.environ.get("TORCHFT_LIGHTHOUSE", "")).hostname
    local = lighthouse in ("127.0.0.1", "localhost")  # all groups on this machine: peers meet on loopback
    return tm.ReplicaGroups(min_replicas=1, advertise_host="127.0.0.1" if local else None)


def build_model(family: str, vocab_size: int, block: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)  # every layout starts from the same weights
    if family in ("qwen3_moe", "mixtral"):  # mixtures of 8 experts, top-2 (expert parallelism: --layout ep*)
        common = dict(
            vocab_size=vocab_size,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=block,
            num_experts_per_tok=2,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        if family == "mixtral":
            return transformers.MixtralForCausalLM(
                transformers.MixtralConfig(intermediate_size=128, num_local_experts=8, **common)
            )
        return transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                intermediate_size=256,
                moe_intermediate_size=128,
                num_experts=8,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                **common,
            )
        )
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=block,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_embd=128, n_layer=4, n_head=4, n_positions=block, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def build_from_pretrained(directory: str, vocab_size: int) -> torch.nn.Module:
    """The model of ``directory``'s config, on the meta device: the Trainer fills it from the files."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    if config.vocab_size < vocab_size:
        raise SystemExit(
            f"--init-from {directory}: its vocabulary has {config.vocab_size} entries; this text needs {vocab_size}"
        )
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def build_distribution(
    layout: str, model: torch.nn.Module, schedule: str = "1f1b", microbatches: int = 4, context_parallel: str = "auto"
) -> tm.Distribution:
    world = tm.world_size()
    if layout == "cp+tp":  # a sequence axis of 2, the model axis over the rest, with sequence parallelism
        seq = 2 if world % 2 == 0 else 1
        mesh = tm.DeviceMesh((1, seq, world // seq), ["data", "seq", "model"], devices=tm.list_devices())
        return tm.ModelParallel(
            layout_map=tm.LayoutMap.auto(model, mesh, model_axis="model"),
            batch_dim_name="data",
            sequence_dim_name="seq",
            context_parallel=context_parallel,
            sequence_parallel=world // seq > 1,
        )
    if layout.startswith("cp"):  # a sequence axis of 2 (of 1 on one process), data over the rest
        seq = 2 if world % 2 == 0 else 1
        mesh = tm.DeviceMesh((world // seq, seq), ["data", "seq"], devices=tm.list_devices())
        return tm.DataParallel(
            mesh, sequence_dim_name="seq", context_parallel=context_parallel, zero_stage=3 if layout == "cp+fsdp" else 0
        )
    if layout in ("pp", "3d"):
        return build_pipeline(layout, model, world, tm.Pipeline(schedule=schedule, microbatches=microbatches))
    if layout == "dp":
        return tm.DataParallel()
    if layout == "fsdp":
        return tm.DataParallel(zero_stage=3)
    if layout.startswith("ep"):  # experts over the batch axis; attention over "model" with ep+tp
        data = world // 2 if layout == "ep+tp" and world % 2 == 0 and world > 1 else world
        mesh = tm.DeviceMesh((data, world // data), ["data", "model"], devices=tm.list_devices())
        layout_map = tm.LayoutMap.auto(model, mesh, expert_axis="data", model_axis="model")
        return tm.ModelParallel(
            layout_map=layout_map, batch_dim_name="data", zero_stage=3 if layout == "ep+fsdp" else 0
        )
    data = 2 if layout == "tp+fsdp" and world % 2 == 0 and world > 1 else 1
    mesh = tm.DeviceMesh((data, world // data), ["data", "model"], devices=tm.list_devices())
    layout_map = tm.LayoutMap.auto(model, mesh)
    return tm.ModelParallel(
        layout_map=layout_map,
        batch_dim_name="data",
        zero_stage=3 if layout == "tp+fsdp" else 0,
        sequence_parallel=layout == "sp",
    )


def build_pipeline(layout: str, model: torch.nn.Module, world: int, pipeline: tm.Pipeline) -> tm.Distribution:
    if layout == "pp":
        mesh = tm.DeviceMesh((world, 1), ["pipe", "data"], devices=tm.list_devices())
        return tm.DataParallel(device_mesh=mesh, pipeline=pipeline)
    if world % 4:
        raise ValueError(
            f"--layout 3d is pipe 2 x data N/4 x model 2 and needs a multiple of 4 processes. "
            f"Received: {world} processes"
        )
    mesh = tm.DeviceMesh((2, world // 4, 2), ["pipe", "data", "model"], devices=tm.list_devices())
    layout_map = tm.LayoutMap.auto(model, mesh, model_axis="model")
    return tm.ModelParallel(layout_map=layout_map, batch_dim_name="data", pipeline=pipeline)


def lm_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama")
    parser.add_argument("--layout", choices=LAYOUTS, default="dp")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (pp, 3d)")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches per step (pp, 3d)")
    parser.add_argument(
        "--context-parallel",
        choices=("ring", "ulysses", "auto"),
        default="auto",
        help="attention over the split sequence (cp, cp+fsdp)",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per epoch")
    parser.add_argument("--epochs", type=int, default=1, help="epochs in all (a resumed run continues to it)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--block", type=int, default=64, help="sequence length (characters)")
    parser.add_argument("--out", default="transformers-lm", help="checkpoint directory")
    parser.add_argument("--resume", action="store_true", help="resume from --out (any layout saved it)")
    parser.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from a local Hugging Face checkpoint (meta build, each process reading its own shards)",
    )
    parser.add_argument("--save-pretrained", metavar="OUT", help="save the trained model in the Hugging Face layout")
    parser.add_argument(
        "--replica-groups",
        type=int,
        metavar="G",
        help="train as one of G torchft replica groups (launch with trainmesh run -n N --replica-groups G)",
    )
    args = parser.parse_args()
    groups = replica_groups(args.replica_groups, parser)
    tm.initialize()

    text = "".join(read_sources(select_sources(stdlib_dir(), 400_000, 20_000), 400_000, 20_000))
    vocab = CharVocab.from_text(text)
    data = CharWindows(vocab.encode(text), args.block)
    samples = min(len(data), args.steps * args.batch_size)
    subset = torch.utils.data.Subset(data, range(samples))

    if args.init_from:
        model = build_from_pretrained(args.init_from, len(vocab))
    else:
        model = build_model(args.model, len(vocab), args.block)
    distribution = build_distribution(args.layout, model, args.schedule, args.microbatches, args.context_parallel)
    trainer = tm.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        lm_loss,
        distribution=distribution,
        max_grad_norm=1.0,
        callbacks=[tm.ShardedCheckpoint(args.out, async_save=False)],
        weights=args.init_from,
        fault_tolerance=groups,
    )
    start = time.perf_counter()
    history = trainer.fit(subset, epochs=args.epochs, batch_size=args.batch_size, resume=args.resume)
    seconds = time.perf_counter() - start
    if tm.is_main_process():
        steps = len(history.steps)
        tokens = steps * args.batch_size * args.block
        loss = history.steps[-1]["loss"] if steps else float("nan")
        print(
            f"{args.model} {args.layout} on {tm.world_size()} processes: {steps} steps, final loss {loss:.6f}, "
            f"{tokens / max(seconds, 1e-9):,.0f} tokens/s; checkpoint in {args.out}"
        )
    if args.save_pretrained:
        tm.save_pretrained(trainer.model, args.save_pretrained)  # collective: every process takes part
        if tm.is_main_process():
            print(f"saved in the Hugging Face layout: {args.save_pretrained}")
    tm.shutdown()


if __name__ == "__main__":
    main()
