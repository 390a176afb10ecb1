"""Mixed dtypes under LoRA: a frozen bf16 (or fp16) base, fp32 adapters, ``precision="bf16-mixed"``.

What a user writes: ``peft.get_peft_model(base.to(torch.bfloat16), LoraConfig(...))`` (peft keeps the
adapters fp32) and ``tm.Trainer(..., precision="bf16-mixed")``. One launch of 2 gloo processes trains
it under DataParallel, ZeRO 1 and 3 and ModelParallel with ``LayoutMap.auto``, and an fp16 base under
DataParallel and ZeRO-3, and checks in each:

* parity, step by step, with the one-process peft loop under ``torch.autocast("cpu", bf16)``: from the
  adapters a layout held before step i, that loop's gradient on batch i equals the gradient the layout
  applied (read back from its SGD-with-momentum update), within a tolerance from bf16 rounding (below);
  the loss the layout reports for step i equals the loop's loss;
* the base stays in its own dtype and unchanged, bit for bit, and each process holds it in that dtype
  (its shard under ZeRO and tensor parallelism: no fp32 copy); the adapters are fp32;
* frozen parameters get no gradient; the optimizer holds state for the adapters only, in fp32.

Why step by step rather than one free run: bf16 compute is not bit-reproducible across layouts, and in
this tiny, freshly initialised model a difference of one rounding grows over steps (measured: halving
the batch in ONE process, no layout at all, moved the adapters after 3 steps by 10% of their update
with this optimizer, and by 24% with plain SGD at the same rate). Restarting the reference from the
layout's own adapters at every step bounds what each step adds, which rounding does explain.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainmesh.testing import run_distributed

from lora_cases import GLOBAL_BATCH, STEPS, base_model, data, lm_loss, lora_config, make_sgd

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

# (base dtype, layout, zero stage)
CONFIGS = [
    ("bfloat16", "dp", 0),
    ("bfloat16", "dp", 1),
    ("bfloat16", "dp", 3),
    ("bfloat16", "tp", 0),
    ("float16", "dp", 0),
    ("float16", "dp", 3),
]
LR, MOMENTUM = 0.5, 0.9  # make_sgd's: the applied gradient is read back from the update with them

# Tolerances on each adapter's gradient, relative (L2 over the tensor), per step.
# U is bf16's unit roundoff: 8 significant bits, so rounding moves a value by at most 2**-9 of itself.
U = 2.0**-9
TOLERANCE = {
    # DataParallel and ZeRO: each process runs the one process's per-token ops on half the rows; what
    # changes is where the weight-gradient matmul's bf16 output is rounded (each half rounded, then the
    # halves added in fp32, against the whole sum rounded once): at most ~3U per element where the halves
    # do not cancel. Measured: 1.4-1.5U at every step, bf16 and fp16 bases, DDP and FSDP2 alike.
    "dp": 4 * U,
    # Tensor parallelism changes the forward itself: a row-parallel layer (o_proj, down_proj and their
    # lora_A) adds two bf16 partial outputs, each rounded, and a column-parallel layer's input gradient
    # is two rounded partials too: several extra roundings per block, in the activations, which then
    # propagate through both blocks and through the attention softmax into the small q/k gradients.
    # Measured: 17-23U worst tensor (half of it reproduced in one process by splitting those matmuls the
    # same way); the same runs under fp16-mixed measured 2.5-10 fp16 roundoffs (errors scale with the
    # roundoff, as rounding does and a wrong reduction would not).
    "tp": 64 * U,
}
# The loss is a mean cross-entropy over 128 tokens: its derivative in each logit is at most 1/128 and the
# logits here are O(1), so a few roundings of them move it by a few U at most (measured: below 0.07U).
LOSS_TOLERANCE = 4 * U
# What these tolerances still catch: a stale or unscaled update, a missed or doubled reduction, a batch
# off by one: errors of order 1. And the fp16 base gathered in bf16 by ZeRO (before gather_dtype): 20-50U.


def lora_model(dtype: torch.dtype) -> torch.nn.Module:
    """The user's model: the base cast to ``dtype``, then peft (adapters fp32: autocast_adapter_dtype)."""
    model = base_model("llama").to(dtype)
    torch.manual_seed(1)
    return peft.get_peft_model(model, lora_config("llama"))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _run_all() -> dict:
    import trainmesh as tm
    from trainmesh._torch.state import full_model_state

    class Snapshots(tm.Callback):
        """The full model state before the first step and the adapters after each step (rank 0)."""

        def on_train_begin(self, logs=None):
            self.start, self.adapters = None, []

        def on_train_batch_begin(self, step, logs=None):
            if self.start is None:
                self.start = self._state()
                self.adapters.append({k: v for k, v in self.start.items() if "lora_" in k})

        def on_train_batch_end(self, step, logs=None):
            self.adapters.append({k: v for k, v in self._state().items() if "lora_" in k})

        def _state(self):
            return {k: v.detach().clone() for k, v in full_model_state(self.trainer.model).items()}

    out = {}
    for config in CONFIGS:
        dtype, layout, stage = getattr(torch, config[0]), config[1], config[2]
        model = lora_model(dtype)
        distribution = None
        if layout == "tp":
            mesh = tm.DeviceMesh((1, 2), ["data", "model"], devices=tm.list_devices())
            distribution = tm.ModelParallel(
                layout_map=tm.LayoutMap.auto(model, mesh, verbose=False), batch_dim_name="data"
            )
        snapshots = Snapshots()
        trainer = tm.Trainer(
            model,
            make_sgd,
            lm_loss,
            distribution=distribution,
            zero_stage=stage,
            precision="bf16-mixed",
            callbacks=[snapshots],
            log_every_n_steps=1,
            progress=False,
        )
        history = trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
        params = dict(trainer.unwrapped_model.named_parameters())  # names without DDP's "module."
        trainable = {id(p) for p in params.values() if p.requires_grad}
        out[config] = {
            "start": snapshots.start,
            "adapters": snapshots.adapters,
            "end": {k: v.detach().clone() for k, v in full_model_state(trainer.model).items()},
            "losses": [r["loss"] for r in history.steps],
            # what this process holds: (dtype, trainable, rows, bytes) of each parameter's local tensor
            "held": {
                n: (
                    _local(p).dtype,
                    p.requires_grad,
                    _local(p).shape[0] if _local(p).dim() else 1,
                    _local(p).numel() * _local(p).element_size(),
                )
                for n, p in params.items()
            },
            "frozen_grads": [n for n, p in params.items() if not p.requires_grad and p.grad is not None],
            "state": [
                (id(p) in trainable, {k: _local(v).dtype for k, v in s.items() if torch.is_tensor(v) and v.dim()})
                for p, s in trainer.optimizer.state.items()
            ],
            "trainable_count": len(trainable),
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run_all, world_size=2, timeout=280)


def _reference_step(model: torch.nn.Module, adapters: dict, step: int) -> tuple[float, dict]:
    """The one-process loop's loss and adapter gradients on batch ``step``, from ``adapters``."""
    model.load_state_dict(adapters, strict=False)
    model.zero_grad(set_to_none=True)
    x, y = data()
    rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model(x[rows]), y[rows])
    loss.float().backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_every_step_matches_one_process_within_bf16_rounding(results):
    for config in CONFIGS:
        got = results[0][config]
        reference = lora_model(getattr(torch, config[0]))
        snaps, tolerance = got["adapters"], TOLERANCE[config[1]]
        assert len(snaps) == STEPS + 1 and len(got["losses"]) == STEPS, config
        for step in range(STEPS):
            loss, grads = _reference_step(reference, snaps[step], step)
            assert abs(got["losses"][step] - loss) <= LOSS_TOLERANCE, (config, step, got["losses"][step], loss)
            before, after = snaps[step], snaps[step + 1]
            earlier = snaps[step - 1] if step else before
            assert grads.keys() == after.keys(), config
            for name, grad in grads.items():
                # torch's SGD: buf = momentum * buf + g; p -= lr * buf. So the g applied at step i is
                # ((p[i-1] - p[i]) - momentum * (p[i-2] - p[i-1])) / lr (no buf before the first step)
                applied = ((before[name] - after[name]) - MOMENTUM * (earlier[name] - before[name])) / LR
                error = ((applied - grad).norm() / grad.norm()).item()
                assert error <= tolerance, (
                    f"{config} step {step}: {name} gradient differs from one process by "
                    f"{error / U:.1f} bf16 roundoffs (tolerance {tolerance / U:.0f})"
                )
        moved = max((snaps[-1][n] - snaps[0][n]).abs().max().item() for n in snaps[0])
        assert moved > 1e-2, config  # the adapters trained


def test_base_stays_in_its_dtype_and_unchanged(results):
    for config in CONFIGS:
        dtype = getattr(torch, config[0])
        got = results[0][config]
        user = lora_model(dtype).state_dict()  # what the user passed in
        assert got["end"].keys() == user.keys(), config
        for name, value in got["end"].items():
            if "lora_" in name:
                assert value.dtype == torch.float32, (config, name, value.dtype)
            else:
                assert value.dtype == dtype, (config, name, value.dtype)
                assert torch.equal(value, user[name]) and torch.equal(got["start"][name], user[name]), (config, name)


def test_each_process_holds_the_base_in_its_own_dtype(results):
    user = {dtype: dict(lora_model(getattr(torch, dtype)).named_parameters()) for dtype in ("bfloat16", "float16")}
    for rank, rank_result in enumerate(results):
        for config in CONFIGS:
            dtype, layout, stage = getattr(torch, config[0]), config[1], config[2]
            held = rank_result[config]["held"]
            for name, (local_dtype, trainable, rows, nbytes) in held.items():
                assert local_dtype == (torch.float32 if trainable else dtype), (config, rank, name, local_dtype)
                whole = user[config[0]][name]
                if layout == "dp" and stage == 0:  # DDP: a whole replica
                    assert nbytes == whole.numel() * whole.element_size(), (config, name)
                elif layout == "dp":  # FSDP2: its rows of dim 0 (torch.chunk's split), nothing upcast
                    first = math.ceil(whole.shape[0] / 2)
                    expected_rows = first if rank == 0 else whole.shape[0] - first
                    assert rows == expected_rows, (config, rank, name, rows)
                    assert nbytes == expected_rows * (whole.numel() // whole.shape[0]) * whole.element_size()


def test_no_gradient_and_no_optimizer_state_for_the_base(results):
    for rank_result in results:
        for config in CONFIGS:
            got = rank_result[config]
            assert got["frozen_grads"] == [], config
            assert len(got["state"]) == got["trainable_count"], config
            for trainable, tensors in got["state"]:
                assert trainable, config
                assert tensors and all(d == torch.float32 for d in tensors.values()), (config, tensors)
