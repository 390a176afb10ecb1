"""Train the project's GPT on a 3-D layout, pipe x data x model, and check it against one process.

    trainmesh run -n 8 examples/hybrid_3d.py                     # pipe 2 x data 2 x model 2
    trainmesh run -n 8 examples/hybrid_3d.py --schedule interleaved_1f1b --zero 2
    python examples/hybrid_3d.py                                  # the same script on one process

The layers are split over "pipe" (torch.distributed.pipelining, the schedule you name), each
stage's attention and MLP projections are column-/row-sharded over "model" (LayoutMap.auto), and
every global batch is split over "data" (with ``--zero 2|3``, FSDP2 shards each stage over it too).
Only the mesh changes between 1 and 8 processes. At the end the first process trains the same
model on the same batches alone, with a plain loop, and prints the largest parameter difference.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist

import trainmesh as tm
from trainmesh.demo.char_gpt import CharGPT, GPTConfig, lm_loss
from trainmesh.demo.corpus import CharVocab, CharWindows, read_sources, select_sources, stdlib_dir


def build_model(vocab_size: int, block: int) -> torch.nn.Module:
    torch.manual_seed(0)  # every layout starts from the same weights
    return CharGPT(GPTConfig(vocab_size=vocab_size, block_size=block, n_layer=4, n_head=4, d_model=64))


def mesh_shape(world: int) -> tuple[int, int, int]:
    """pipe x data x model: 2 x 2 x 2 on 8 processes; smaller worlds fill pipe, then data."""
    pipe = 2 if world % 2 == 0 else 1
    model = 2 if world % (pipe * 2) == 0 and world >= 8 else 1
    return pipe, world // (pipe * model), model


def local_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
        for name, p in model.named_parameters()
    }


def single_process_reference(vocab_size: int, block: int, data, batch_size: int, steps: int, lr: float):
    model = build_model(vocab_size, block)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = zip(*(data[i] for i in range(step * batch_size, (step + 1) * batch_size)))
        optimizer.zero_grad()
        lm_loss(model(torch.stack(x)), torch.stack(y)).backward()
        optimizer.step()
    return dict(model.named_parameters(remove_duplicate=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved_1f1b, looped_bfs, ...")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--zero", type=int, default=0, choices=(0, 2, 3))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--block", type=int, default=32, help="sequence length (characters)")
    args = parser.parse_args()
    tm.initialize()

    text = "".join(read_sources(select_sources(stdlib_dir(), 200_000, 20_000), 200_000, 20_000))
    vocab = CharVocab.from_text(text)
    data = CharWindows(vocab.encode(text), args.block)
    subset = torch.utils.data.Subset(data, range(args.steps * args.batch_size))

    shape = mesh_shape(tm.world_size())
    mesh = tm.DeviceMesh(shape, ["pipe", "data", "model"], devices=tm.list_devices())
    model = build_model(len(vocab), args.block)
    layout_map = tm.LayoutMap.auto(model, mesh, model_axis="model", verbose=False)
    pipeline = tm.Pipeline(axis="pipe", schedule=args.schedule, microbatches=args.microbatches)
    distribution = tm.ModelParallel(
        layout_map=layout_map, batch_dim_name="data", pipeline=pipeline, zero_stage=args.zero
    )
    lr = 0.1
    trainer = tm.Trainer(
        model,
        lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
        lm_loss,
        distribution=distribution,
        progress=tm.is_main_process(),
    )
    history = trainer.fit(subset, epochs=1, batch_size=args.batch_size, shuffle=False)

    held = local_parameters(trainer.model)  # this process's stages, full tensors, global names
    gathered = [None] * tm.world_size() if tm.is_main_process() else None
    if dist.is_initialized() and tm.world_size() > 1:
        dist.gather_object(held, gathered, dst=0)
    else:
        gathered = [held]
    if tm.is_main_process():
        reference = single_process_reference(len(vocab), args.block, data, args.batch_size, args.steps, lr)
        worst = max(
            (reference[name].detach() - value).abs().max().item() for part in gathered for name, value in part.items()
        )
        print(
            f"mesh pipe x data x model = {' x '.join(map(str, shape))}, schedule {args.schedule}, "
            f"ZeRO {args.zero}: final loss {history.history['loss'][-1]:.4f}; "
            f"max |parameter - single process| = {worst:.3g}",
            flush=True,
        )
        if not math.isfinite(worst) or worst > 1e-4:
            raise SystemExit(f"the 3-D run differs from one process by {worst:.3g}")
    tm.shutdown()


if __name__ == "__main__":
    main()
