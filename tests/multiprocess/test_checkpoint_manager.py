"""CheckpointManager on real gloo groups: resharding across world sizes and ZeRO stages.

Three launches (2 -> 4 -> 2 processes). A small MLP with Adam trains 3 steps and is saved;
the saving run then takes step 4, which is the reference. Every load into another world
size / ZeRO stage takes that same step 4 and must land within 1e-6 of the reference,
so model *and* optimizer state (Adam moments, step count) were restored. Also checked:
an async save loads to the same numbers as a sync one, per-rank RNG and data state come
back (rank r <- saved rank r % old world), and a safetensors export loads into a plain module.
Transitions: 2 -> 4 (stage 0 -> 3, 3 -> 0, async -> 0), 4 -> 2 (0 -> 0, 3 -> 3, 3 -> 0, 0 -> 1),
and on 2, stage 1 (ZeroRedundancyOptimizer) -> 3.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

GLOBAL_BATCH, STEPS = 16, 3


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # 64 x 64 weights are large enough that DDP's replicas get split between writers.
        self.inp = torch.nn.Linear(8, 64)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)])
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


class Cursor:
    """Stands in for a data loader: per-rank state with state_dict/load_state_dict."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _batch(step):
    import trainmesh as tm

    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    r, w = tm.rank(), tm.world_size()
    per = GLOBAL_BATCH // w
    return x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]


def _build(stage):
    import trainmesh as tm

    dist = tm.DataParallel(zero_stage=stage)
    model = dist.distribute_model(MLP())
    optimizer = dist.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model)
    return model, optimizer


def _step(model, optimizer, step):
    x, y = _batch(step)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _full(model):
    from trainmesh._torch.dcp import full_model_state_on_rank0

    return {k: v.clone() for k, v in full_model_state_on_rank0(model).items()}


def _train_save(directory, stage, async_dir=None, export_path=None):
    """Train STEPS, save (sync, and async to async_dir), then take the reference step."""
    import trainmesh as tm
    from trainmesh.checkpoint import CheckpointManager, export_consolidated

    model, optimizer = _build(stage)
    torch.manual_seed(1000 + tm.rank())  # ranks draw different streams, as with per-rank dropout
    for step in range(STEPS):
        _step(model, optimizer, step)
    state = {
        "model": model,
        "optimizer": optimizer,
        "data": Cursor(100 + tm.rank()),
        "trainer": {"global_step": STEPS, "epoch": 1},
    }
    manager = CheckpointManager(directory)
    manager.save(STEPS, state, metrics={"loss": 1.0})
    if async_dir:
        async_manager = CheckpointManager(async_dir, async_save=True)
        async_manager.save(STEPS, state)
        _step(model, optimizer, 99)  # training mutates the state while the write is in flight
        async_manager.close()
        model, optimizer = _build(stage)  # redo the run without the disturbing step
        manager.load("latest", {"model": model, "optimizer": optimizer})
    exported = None
    if export_path:
        export_consolidated(export_path, model)
        exported = _full(model)
    draw = torch.rand(1).item()  # what this rank's generator yields right after the save
    _step(model, optimizer, STEPS)
    return {"reference": _full(model), "draw": draw, "exported": exported}


def _load_step(directory, stage):
    import trainmesh as tm
    from trainmesh.checkpoint import CheckpointManager

    model, optimizer = _build(stage)
    cursor = Cursor()
    meta = CheckpointManager(directory).load("latest", {"model": model, "optimizer": optimizer, "data": cursor})
    draw = torch.rand(1).item()
    _step(model, optimizer, STEPS)
    return {"params": _full(model), "meta": meta, "cursor": cursor.value, "draw": draw, "rank": tm.rank()}


def launch_a(root):
    out = {"s0": _train_save(f"{root}/s0_w2", 0, async_dir=f"{root}/async_w2", export_path=f"{root}/w2.safetensors")}
    out["s3"] = _train_save(f"{root}/s3_w2", 3)
    return out


def launch_b(root):
    return {
        "s0_to_s3": _load_step(f"{root}/s0_w2", 3),
        "async_to_s0": _load_step(f"{root}/async_w2", 0),
        "s3_to_s0": _load_step(f"{root}/s3_w2", 0),
        "save_s0": _train_save(f"{root}/s0_w4", 0),
        "save_s3": _train_save(f"{root}/s3_w4", 3),
    }


def launch_c(root):
    return {
        "s0_to_s0": _load_step(f"{root}/s0_w4", 0),
        "s3_to_s3": _load_step(f"{root}/s3_w4", 3),
        "s3_to_s0": _load_step(f"{root}/s3_w4", 0),
        "s0_to_s1": _load_step(f"{root}/s0_w4", 1),
        "save_s1": _train_save(f"{root}/s1_w2", 1),
        "s1_to_s3": _load_step(f"{root}/s1_w2", 3),
    }


def _close(a, b, tol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=tol, rtol=0, msg=lambda m: f"{k}: {m}")


def test_reshard_across_world_sizes_and_zero_stages():
    with tempfile.TemporaryDirectory() as root:
        a = run_distributed(launch_a, world_size=2, args=(root,))
        b = run_distributed(launch_b, world_size=4, args=(root,))
        c = run_distributed(launch_c, world_size=2, args=(root,))

        ref_s0, ref_s3 = a[0]["s0"]["reference"], a[0]["s3"]["reference"]
        _close(ref_s0, ref_s3, tol=1e-5)  # sanity: stage 0 and 3 train the same model
        _close(b[0]["s0_to_s3"]["params"], ref_s0)  # 2 -> 4, stage 0 -> 3
        _close(b[0]["async_to_s0"]["params"], ref_s0)  # async save == sync save
        _close(b[0]["s3_to_s0"]["params"], ref_s3)  # 2 -> 4, stage 3 -> 0
        _close(c[0]["s0_to_s0"]["params"], b[0]["save_s0"]["reference"])  # 4 -> 2
        _close(c[0]["s3_to_s3"]["params"], b[0]["save_s3"]["reference"])  # 4 -> 2, stage 3
        _close(c[0]["s3_to_s0"]["params"], b[0]["save_s3"]["reference"])  # 4 -> 2, stage 3 -> 0
        _close(c[0]["s0_to_s1"]["params"], b[0]["save_s0"]["reference"])  # 4 -> 2, stage 0 -> 1
        _close(c[0]["s1_to_s3"]["params"], c[0]["save_s1"]["reference"])  # stage 1 -> 3

        # Per-rank state: rank r <- saved rank r % 2; ranks 2 and 3 reseeded, distinct streams.
        loads = [r["s0_to_s3"] for r in b]
        assert [r["cursor"] for r in loads] == [100, 101, 100, 101]
        assert [r["draw"] for r in loads[:2]] == [a[0]["s0"]["draw"], a[1]["s0"]["draw"]]
        assert len({r["draw"] for r in loads}) == 4
        assert loads[0]["meta"]["trainer"] == {"global_step": STEPS, "epoch": 1}
        assert loads[0]["meta"]["step"] == STEPS and loads[0]["meta"]["metrics"] == {"loss": 1.0}
        assert [r["s0_to_s0"]["cursor"] for r in c] == [100, 101]

        # The consolidated export loads into a plain, undistributed module.
        import safetensors.torch

        plain = MLP()
        plain.load_state_dict(safetensors.torch.load_file(os.path.join(root, "w2.safetensors")))
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(value, a[0]["s0"]["exported"][name], atol=0, rtol=0)
        assert all(not n.endswith(".tmp") for n in os.listdir(f"{root}/s0_w2"))
