"""The Trainer on real gloo process groups: parity, accumulation, fp16 skips, exact metrics, stop.

Every scenario runs inside a few launches (process start-up is the expensive part); each
returns plain numbers that the tests compare. Tolerances are stated where used.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

N_SAMPLES, GLOBAL_BATCH, EPOCHS = 96, 16, 2


def make_data(n: int = N_SAMPLES, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()  # 3 classes
    return x, y


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def train_with_trainer(
    grad_accum_steps: int = 1,
    precision: str = "fp32",
    max_grad_norm=None,
    distribution=None,
    callbacks=None,
    epochs: int = EPOCHS,
    batch: int = GLOBAL_BATCH,
    data=None,
) -> dict:
    import trainmesh as tm

    model = make_model()
    trainer = tm.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
        torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"],
        distribution=distribution,
        callbacks=callbacks,
        grad_accum_steps=grad_accum_steps,
        precision=precision,
        max_grad_norm=max_grad_norm,
        progress=False,
    )
    history = trainer.fit(
        make_data() if data is None else data, epochs=epochs, batch_size=None if data is not None else batch
    )
    return {
        "step_losses": [s["loss"] for s in history.steps],
        "epoch_loss": history.history["loss"],
        "accuracy": history.history["accuracy"],
        "grad_norms": [s.get("grad_norm") for s in history.steps],
        "params": params_of(trainer.unwrapped_model),
        "global_step": trainer.global_step,
        "trainer": trainer,
    }


def hand_written_reference(max_grad_norm=None) -> dict:
    """A plain torch loop over the same global batches (same order as trainmesh's seeded shuffle)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = make_data()
    losses, norms = [], []
    for epoch in range(EPOCHS):
        order = torch.as_tensor(np.random.default_rng([0, epoch]).permutation(N_SAMPLES))
        for start in range(0, N_SAMPLES, GLOBAL_BATCH):
            idx = order[start : start + GLOBAL_BATCH]
            optimizer.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            if max_grad_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
            optimizer.step()
            losses.append(loss.item())
    return {"step_losses": losses, "params": params_of(model), "grad_norms": norms}


# --- launch 1: one process -----------------------------------------------------------------
def _one_process() -> dict:
    plain = train_with_trainer()
    clipped = train_with_trainer(max_grad_norm=0.5)
    accumulated = train_with_trainer(grad_accum_steps=4)
    return {
        "plain": _strip(plain),
        "clipped": _strip(clipped),
        "accumulated": _strip(accumulated),
        "eval": _evaluate_uneven(),
        "loaders": _from_loaders(),
    }


def _from_loaders() -> dict:
    """A DataLoader of GLOBAL batches (split by trainmesh), and one with a DistributedSampler (already split)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import trainmesh as tm

    dataset = TensorDataset(*make_data())
    global_batches = DataLoader(dataset, batch_size=GLOBAL_BATCH, shuffle=False)
    sampler = DistributedSampler(dataset, num_replicas=tm.world_size(), rank=tm.rank(), shuffle=False)
    presharded = DataLoader(dataset, batch_size=GLOBAL_BATCH // tm.world_size(), sampler=sampler)
    return {
        "global": _strip(train_with_trainer(data=global_batches)),
        "presharded": _strip(train_with_trainer(data=presharded, grad_accum_steps=1)),
    }


def _strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "trainer"}


def _evaluate_uneven() -> dict:
    """Evaluate 37 samples with batch 8 (last batch 5: uneven over 2 and 4 processes)."""
    import trainmesh as tm

    model = make_model(seed=3)
    trainer = tm.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"],
        progress=False,
    )
    logs = trainer.evaluate(make_data(37, seed=5), batch_size=8)
    predictions = trainer.predict(make_data(37, seed=5), batch_size=8)
    return {"logs": logs, "predictions": predictions}


@pytest.fixture(scope="module")
def single():
    return run_distributed(_one_process, world_size=1, timeout=240)[0]


def test_trainer_is_bit_identical_to_a_hand_written_loop(single):
    reference = hand_written_reference()
    assert single["plain"]["step_losses"] == reference["step_losses"]  # exact, fp32, one process
    for name, value in reference["params"].items():
        assert torch.equal(single["plain"]["params"][name], value), name


def test_clipping_matches_torch_clip_grad_norm(single):
    reference = hand_written_reference(max_grad_norm=0.5)
    np.testing.assert_allclose(single["clipped"]["grad_norms"], reference["grad_norms"], rtol=1e-6)
    assert max(reference["grad_norms"]) > 0.5  # the clip really engaged
    for name, value in reference["params"].items():
        torch.testing.assert_close(single["clipped"]["params"][name], value, rtol=1e-5, atol=1e-6)


def test_accumulation_equals_one_big_batch(single):
    # 4 micro-batches of 4 give the update of one batch of 16 (fp32, 1e-5).
    np.testing.assert_allclose(single["accumulated"]["step_losses"], single["plain"]["step_losses"], rtol=1e-5)
    for name, value in single["plain"]["params"].items():
        torch.testing.assert_close(single["accumulated"]["params"][name], value, rtol=1e-5, atol=1e-6)


# --- launches 2 and 3: two and four processes --------------------------------------------------
def _multi_process() -> dict:
    import torch.distributed as dist

    import trainmesh as tm

    rank = tm.rank()
    out = {
        "plain": _strip(train_with_trainer()),
        "accumulated": _strip(train_with_trainer(grad_accum_steps=2)),
        "clipped": _strip(train_with_trainer(max_grad_norm=0.5)),
        "eval": _evaluate_uneven(),
        "loaders": _from_loaders(),
    }

    # Collectives per optimizer step do not grow with accumulation: count DDP's all-reduces.
    counts = {}
    for k in (1, 4):
        model = make_model()
        trainer = tm.Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.nn.CrossEntropyLoss(),
            grad_accum_steps=k,
            progress=False,
        )
        calls = [0]

        def counting_hook(state, bucket, calls=calls):
            calls[0] += 1
            tensor = bucket.buffer().div_(dist.get_world_size())
            return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

        trainer.model.register_comm_hook(None, counting_hook)
        trainer.fit(make_data(), epochs=1, batch_size=GLOBAL_BATCH)
        counts[k] = (calls[0], trainer.global_step)
    out["allreduce_counts"] = counts

    # A stop requested on rank 1 alone, mid-epoch: every rank stops after the same step.
    class StopOnRank1(tm.Callback):
        def on_train_batch_end(self, step, logs=None):
            if rank == 1 and step == 2:
                self.trainer.request_stop("rank 1 asked")

    stopped = train_with_trainer(callbacks=[StopOnRank1()], epochs=3)
    out["stopped_at"] = stopped["global_step"]
    out["stop_reason_local"] = stopped["trainer"].stop_reason
    out["fp16"] = _fp16_overflow_on_rank_1(rank)
    return out


def _fp16_overflow_on_rank_1(rank: int) -> dict:
    """fp16-mixed, with an inf injected into one gradient on rank 1 only, at the third step."""
    import trainmesh as tm

    model = make_model()
    trainer = tm.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.CrossEntropyLoss(),
        precision="fp16-mixed",
        progress=False,
    )
    scaler = trainer.precision.scaler
    unscale = scaler.unscale_

    def unscale_with_overflow_on_rank_1(params):
        params = list(params)
        if rank == 1 and trainer.global_step == 2:
            params[0].grad.view(-1)[0] = float("inf")  # after DDP's all-reduce: only this rank sees it
        return unscale(params)

    scaler.unscale_ = unscale_with_overflow_on_rank_1
    history = trainer.fit(make_data(), epochs=1, batch_size=GLOBAL_BATCH)
    return {
        "skipped": [s["skipped"] for s in history.steps],
        "scales": [s["loss_scale"] for s in history.steps],
        "skipped_total": scaler.skipped_steps,
        "params": params_of(trainer.unwrapped_model),
        "epoch_logs": history.last_epoch(),
    }


@pytest.fixture(scope="module")
def two():
    return run_distributed(_multi_process, world_size=2, timeout=300)


@pytest.fixture(scope="module")
def four():
    return run_distributed(_multi_process, world_size=4, timeout=400)


@pytest.mark.parametrize("world", ["two", "four"])
def test_data_parallel_parity_across_world_sizes(single, world, request):
    results = request.getfixturevalue(world)
    for variant in ("plain", "accumulated", "clipped"):
        want = single["plain"] if variant == "accumulated" else single[variant]
        for result in results:
            # fp32, different reduction order: 1e-5 relative on losses, 1e-5 on parameters.
            np.testing.assert_allclose(result[variant]["step_losses"], want["step_losses"], rtol=1e-5)
            np.testing.assert_allclose(result[variant]["accuracy"], want["accuracy"], rtol=0, atol=0)
            for name, value in want["params"].items():
                torch.testing.assert_close(result[variant]["params"][name], value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", ["two", "four"])
def test_evaluate_is_exact_with_an_uneven_last_batch(single, world, request):
    for result in request.getfixturevalue(world):
        assert result["eval"]["logs"]["accuracy"] == single["eval"]["logs"]["accuracy"]
        # Loss: each share's mean is computed in fp32 (rounding ~1e-7); weighting by rows is exact, and a
        # mean of per-rank means would be off by far more (the 5-row last batch splits 3+2 or 2+1+1+1).
        assert result["eval"]["logs"]["loss"] == pytest.approx(single["eval"]["logs"]["loss"], rel=1e-6)
        torch.testing.assert_close(result["eval"]["predictions"], single["eval"]["predictions"], rtol=0, atol=1e-6)
    assert single["eval"]["predictions"].shape == (37, 3)


@pytest.mark.parametrize("world", ["two", "four"])
def test_accumulation_does_not_add_collectives(world, request):
    for result in request.getfixturevalue(world):
        (calls_1, steps_1), (calls_4, steps_4) = result["allreduce_counts"][1], result["allreduce_counts"][4]
        assert steps_1 == steps_4 == N_SAMPLES // GLOBAL_BATCH
        assert calls_1 == calls_4 >= steps_1  # one bucket (or more) per optimizer step, not per micro-step
        assert calls_1 % steps_1 == 0


@pytest.mark.parametrize("world", ["two", "four"])
def test_stop_from_one_rank_is_honoured_by_all_at_the_same_step(world, request):
    results = request.getfixturevalue(world)
    stopped = {r["stopped_at"] for r in results}
    assert len(stopped) == 1
    assert stopped.pop() == 4  # requested after step index 2 (3rd step), seen at the next sync: step 4
    assert results[1]["stop_reason_local"] == "rank 1 asked"


@pytest.mark.parametrize("world", ["two", "four"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_all(world, request):
    results = request.getfixturevalue(world)
    for result in results:
        fp16 = result["fp16"]
        assert fp16["skipped"] == [False, False, True, False, False, False]
        assert fp16["scales"][:2] == [2.0**15] * 2 and fp16["scales"][2:] == [2.0**14] * 4
        assert fp16["skipped_total"] == 1 and fp16["epoch_logs"]["skipped_steps"] == 1
        for name, value in results[0]["fp16"]["params"].items():
            assert torch.equal(fp16["params"][name], value), name  # replicas still identical


@pytest.mark.parametrize("world", ["two", "four"])
def test_dataloader_inputs_give_the_same_training(single, world, request):
    # Unshuffled global batches, whether the loader yields global batches or this rank's share.
    want = single["loaders"]["global"]
    assert single["loaders"]["presharded"]["step_losses"] == want["step_losses"]
    for result in request.getfixturevalue(world):
        for kind in ("global", "presharded"):
            got = result["loaders"][kind]
            np.testing.assert_allclose(got["step_losses"], want["step_losses"], rtol=1e-5)
            for name, value in want["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5)
