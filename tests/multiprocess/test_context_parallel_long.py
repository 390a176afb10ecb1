"""Issue 44's longest parity case: a tiny Llama at 2,048 tokens a sequence on a sequence axis of 2, both
methods, 3 AdamW steps of 2 rows through ``tm.Trainer`` against a plain one-process loop on the same
batches (fp32, 1e-6 on the mean loss and on every parameter). Ring attention also with left padding, where
it all-gathers the K/V for the mask (``ring_masked.py``). The short cases (32 tokens, every layout) are in
``test_context_parallel.py``."""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed

from cp_cases import Padded, STEPS, build_model, data, lm_loss, make_optimizer, max_diff, reference

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
pytest.importorskip("transformers")

SEQ_LEN, ROWS, TOLERANCE = 2048, 2, 1e-6


def _left_padded():
    """Odd rows padded at the start (100-700 tokens), padded targets -100."""
    x, y = data(seq=SEQ_LEN, rows=ROWS * STEPS)
    mask, y = torch.ones_like(x), y.clone()
    for row in range(1, len(x), 2):
        pad = 100 * row + 100
        mask[row, :pad], x[row, :pad], y[row, :pad] = 0, 2, -100
    return {"input_ids": x, "attention_mask": mask}, y


CASES = {  # name: (method, padded)
    "ring": ("ring", False),
    "ulysses": ("ulysses", False),
    "ring left padding": ("ring", True),
}


def _batches(padded: bool):
    if not padded:
        return data(seq=SEQ_LEN, rows=ROWS * STEPS)
    inputs, targets = _left_padded()
    rows = range(0, len(targets), ROWS)
    return [({k: v[i : i + ROWS] for k, v in inputs.items()}, targets[i : i + ROWS]) for i in rows]


def _run() -> dict:
    import trainmesh as tm

    mesh = tm.DeviceMesh((2,), ["seq"], devices=tm.list_devices())
    out = {}
    for name, (method, padded) in CASES.items():
        distribution = tm.DataParallel(mesh, sequence_dim_name="seq", context_parallel=method)
        model = Padded(build_model()) if padded else build_model()
        trainer = tm.Trainer(model, make_optimizer, lm_loss, distribution=distribution, progress=False)
        batches = _batches(padded)
        if padded:
            history = trainer.fit(batches, epochs=1)
        else:
            history = trainer.fit(batches, epochs=1, batch_size=ROWS, shuffle=False)
        state = {k.removeprefix("lm."): v.detach().clone() for k, v in trainer.state_dict()["model"].items()}
        out[name] = (state, history.history["loss"][0])
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_run, world_size=2, timeout=280)


@pytest.mark.parametrize("name", list(CASES))
def test_2048_tokens_on_a_sequence_axis_match_one_process(runs, name):
    _, padded = CASES[name]
    inputs, targets = _left_padded() if padded else data(seq=SEQ_LEN, rows=ROWS * STEPS)
    expected, losses = reference(Padded(build_model()) if padded else build_model(), inputs, targets, batch=ROWS)
    expected = {k.removeprefix("lm."): v for k, v in expected.items()}
    for rank, result in enumerate(runs):  # every process reports the global loss
        assert abs(result[name][1] - sum(losses) / len(losses)) <= TOLERANCE, (name, rank, result[name][1], losses)
    diff = max_diff(runs[0][name][0], expected)  # the whole state, gathered on the main process
    assert diff <= TOLERANCE, f"{name}: parameters differ by {diff:.3g}"
