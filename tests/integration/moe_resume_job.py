"""An expert-parallel run for test_moe_resume.py, through `trainmesh run -n 2 --max-restarts 1`.

A tiny Qwen3-MoE (moe_cases) with its experts split over the 2 processes of the data axis (EP 2)
trains 2 epochs of 4 steps, shuffled, with a synchronous ``ShardedCheckpoint`` every 2 steps, resuming
from the latest. In attempt 0, rank 1 SIGKILLs itself after global step ``--kill-at`` (mid-epoch);
torchrun's agent restarts both processes and attempt 1 resumes from step 2's checkpoint (each process
reads its own experts and their AdamW state). Then the same processes train the same run
uninterrupted, and rank 0 writes whether every model and optimizer tensor is ``torch.equal``.
"""

import argparse
import json
import os
import signal
import sys

import torch

import trainmesh as tm
from trainmesh.testing.sample_log import SampleLog

# moe_cases (the model, data and optimizer of the expert-parallel parity tests) lives beside those tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "multiprocess"))
from moe_cases import GLOBAL_BATCH, data, lm_loss, make_optimizer, moe_model  # noqa: E402

EPOCHS, STEPS_PER_EPOCH, EVERY = 2, 4, 2


def train(checkpoint, callbacks=(), resume=False):
    model = moe_model("qwen3_moe")
    mesh = tm.DeviceMesh((tm.world_size(),), ["data"], devices=tm.list_devices())
    layout_map = tm.LayoutMap.auto(model, mesh, expert_axis="data", verbose=False)
    trainer = tm.Trainer(
        model,
        make_optimizer,
        lm_loss,
        distribution=tm.ModelParallel(layout_map=layout_map, batch_dim_name="data"),
        seed=0,
        callbacks=[checkpoint, *callbacks],
        progress=False,
    )
    trainer.fit(data(steps=STEPS_PER_EPOCH), epochs=EPOCHS, batch_size=GLOBAL_BATCH, resume=resume)
    return trainer


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def full_state(trainer) -> dict:
    """Model and optimizer tensors as whole tensors (collective for sharded ones)."""
    state = trainer.state_dict()
    tensors = {f"model/{k}": _full(v) for k, v in state["model"].items()}
    for name, entry in state["optimizer"].get("state", {}).items():
        tensors.update({f"optimizer/{name}/{k}": _full(v) for k, v in entry.items() if torch.is_tensor(v)})
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=3)
    args = parser.parse_args()
    tm.initialize()
    torch.set_num_threads(1)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = tm.rank()

    def kill(global_step):
        if restart == 0 and rank == 1 and global_step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    log = SampleLog(os.path.join(args.out, f"samples.rank{rank}.log"), str(restart), after_step=kill)
    checkpoint = tm.ShardedCheckpoint(os.path.join(args.out, "ckpt"), every_n_steps=EVERY, async_save=False)
    resumed = full_state(train(checkpoint, [log], resume=True))
    reference = full_state(train(tm.ShardedCheckpoint(os.path.join(args.out, "ref_ckpt"), async_save=False)))
    if rank == 0:
        mismatched = [k for k in reference if k not in resumed or not torch.equal(resumed[k], reference[k])]
        result = {"keys": sorted(reference), "attempt": restart, "mismatched": sorted(mismatched)}
        with open(os.path.join(args.out, "result.json"), "w") as fh:
            json.dump(result, fh)
    tm.barrier()
    tm.shutdown()


if __name__ == "__main__":
    main()
