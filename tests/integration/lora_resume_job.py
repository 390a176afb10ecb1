"""A LoRA fine-tune for test_lora_resume.py, run through `trainmesh run -n 2 --max-restarts 2`.

For each layout in turn (DataParallel, then ZeRO-3) it trains lora_cases' peft LoRA Llama with a
``ShardedCheckpoint`` (trainable-only: the default; every 2 steps, async), resuming from the latest
checkpoint. In attempt i, rank 1 SIGKILLs itself after global step ``--kill-at`` of layout i, so
each layout is killed once and resumed by the next attempt; a layout whose result is written is
skipped later. After a layout finishes, the same processes train the same run uninterrupted with
``save_frozen=True`` and rank 0 writes whether every model and optimizer tensor is ``torch.equal``.

The last attempt also loads the DataParallel run's trainable-only checkpoint into ZeRO-3, ZeRO-1
and tensor-parallel trainers (other layouts) and writes their model and optimizer state; then into
a bare model whose trainable set differs on rank 1 only: both ranks must raise the same error
instead of one waiting in DCP's collectives for the other.
"""

import argparse
import json
import os
import signal
import sys

import torch

import trainmesh as tm
from trainmesh.testing.sample_log import SampleLog

# lora_cases (the model, data and optimizer of the LoRA parity tests) lives beside those tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "multiprocess"))
from lora_cases import data, lm_loss, lora_model, make_optimizer  # noqa: E402

LAYOUTS = {"dp": 0, "zero3": 3}  # name -> zero stage, in the order the attempts kill them
# lora_cases.data() has 24 samples: 6 steps per epoch, 12 in all; a save every 2 steps (and at each
# epoch end), so a kill after step 5 resumes mid-epoch, at step 4 (or 2: see the test).
BATCH, EPOCHS, EVERY = 4, 2, 2


def train(zero_stage, checkpoint, callbacks=(), resume=False):
    trainer = tm.Trainer(
        lora_model("llama"),
        make_optimizer,
        lm_loss,
        zero_stage=zero_stage,
        seed=0,
        callbacks=[checkpoint, *callbacks],
        progress=False,
    )
    trainer.fit(data(), epochs=EPOCHS, batch_size=BATCH, resume=resume)
    return trainer


def full_state(trainer) -> dict:
    """Model and optimizer tensors, gathered on rank 0 (collective)."""
    state = trainer.state_dict()
    tensors = {f"model/{k}": v for k, v in state["model"].items()}
    for name, entry in state["optimizer"].get("state", {}).items():
        tensors.update({f"optimizer/{name}/{k}": v for k, v in entry.items() if torch.is_tensor(v)})
    return tensors


def run_layout(out, name, stage, restart, kill_at):
    rank = tm.rank()
    root = os.path.join(out, name)
    os.makedirs(root, exist_ok=True)

    def kill(global_step):
        if restart == list(LAYOUTS).index(name) and rank == 1 and global_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    log = SampleLog(os.path.join(root, f"samples.rank{rank}.log"), f"{name}-{restart}", after_step=kill)
    resumed = full_state(
        train(stage, tm.ShardedCheckpoint(os.path.join(root, "ckpt"), every_n_steps=EVERY), [log], resume=True)
    )
    reference = full_state(
        train(stage, tm.ShardedCheckpoint(os.path.join(root, "ref_ckpt"), every_n_steps=EVERY, save_frozen=True))
    )
    if rank == 0:
        torch.save(resumed, os.path.join(root, "final.pt"))
        mismatched = [k for k in reference if k not in resumed or not torch.equal(resumed[k], reference[k])]
        result = {"keys": sorted(reference), "attempt": restart, "mismatched": sorted(mismatched)}
        with open(os.path.join(root, "result.json"), "w") as fh:
            json.dump(result, fh)
    tm.barrier()  # the result is on disk before any process moves on (a later attempt skips this layout)


def other_layouts_and_mismatch(out):
    """The DataParallel run's trainable-only checkpoint into ZeRO-3, ZeRO-1 and tensor parallel (a
    (1, 2) mesh, LayoutMap.auto), then into a model whose trainable set differs."""
    rank = tm.rank()
    loaded = {}
    for name in ("zero3", "zero1", "tp"):
        model, distribution = lora_model("llama"), None
        if name == "tp":
            mesh = tm.DeviceMesh((1, 2), ["data", "model"], devices=tm.list_devices())
            distribution = tm.ModelParallel(
                layout_map=tm.LayoutMap.auto(model, mesh, verbose=False), batch_dim_name="data"
            )
        checkpoint = tm.ShardedCheckpoint(os.path.join(out, "dp", "ckpt"))
        trainer = tm.Trainer(
            model,
            make_optimizer,
            lm_loss,
            distribution=distribution,
            zero_stage={"zero3": 3, "zero1": 1}.get(name, 0),
            callbacks=[checkpoint],
            progress=False,
        )
        loaded[name] = (checkpoint.resume(), trainer.global_step)
        state = full_state(trainer)
        if rank == 0:
            torch.save(state, os.path.join(out, f"dp_into_{name}.pt"))

    from trainmesh.checkpoint import CheckpointManager

    model = lora_model("llama")
    if rank == 1:  # one rank alone disagrees: a collective entered by the other would wait for it
        model.base_model.model.model.embed_tokens.weight.requires_grad_(True)
    try:
        CheckpointManager(os.path.join(out, "dp", "ckpt")).load("latest", {"model": model})
        error = None
    except ValueError as exc:
        error = str(exc)
    with open(os.path.join(out, f"mismatch.rank{rank}.json"), "w") as fh:
        json.dump({"loaded": loaded, "error": error}, fh)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=5)
    args = parser.parse_args()
    tm.initialize()
    torch.set_num_threads(1)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for name, stage in LAYOUTS.items():
        if not os.path.exists(os.path.join(args.out, name, "result.json")):
            run_layout(args.out, name, stage, restart, args.kill_at)
    other_layouts_and_mismatch(args.out)
    tm.shutdown()


if __name__ == "__main__":
    main()
