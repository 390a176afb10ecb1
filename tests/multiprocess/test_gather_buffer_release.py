"""ZeRO-3 on CPU frees each unit's all-gather buffer once its parameters are copied out
(``_torch/gather_buffer_release.py``), and changes no number.

One launch of 2 gloo processes trains the tiny Llama of ``lora_cases`` (full fine-tuning, every unit ZeRO-3)
under ``DataParallel(zero_stage=3)``, with the release hooks as installed and with them removed (FSDP2's
own deferral). Checked: inside the last block's forward FSDP2's deferred all-gather buffer is gone with the
hooks and held without them (so the check can fail), and every step's loss and every parameter after the
steps are bit-identical between the two.
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed

from lora_cases import GLOBAL_BATCH, base_model, data, lm_loss, make_optimizer

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]
pytest.importorskip("transformers")


def _train(release: bool) -> dict:
    import trainmesh as tm

    trainer = tm.Trainer(
        base_model("llama"), make_optimizer, lm_loss, distribution=tm.DataParallel(zero_stage=3), progress=False
    )
    model = trainer.model
    handles = model._trainmesh_gather_release
    assert len(handles) >= 3  # the root and both blocks at least
    if not release:
        for handle in handles:
            handle.remove()
    held = []
    block = model.model.layers[-1]
    # registered after the release hook: sees what a block's forward runs with
    block.register_forward_pre_hook(
        lambda m, a: held.append(m._get_fsdp_state()._comm_ctx.all_gather_state is not None)
    )
    x, y = data()
    history = trainer.fit((x, y), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
    state = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }
    return {"held": held, "losses": [r["loss"] for r in history.steps], "state": state}


def _run() -> dict:
    return {release: _train(release) for release in (True, False)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, world_size=2, timeout=220)


def test_the_deferred_buffer_is_freed_and_no_number_changes(results):
    for rank_result in results:
        released, deferred = rank_result[True], rank_result[False]
        assert released["held"] and not any(released["held"]), released["held"]
        assert any(deferred["held"]), "FSDP2 deferred no buffer: the check above proves nothing"
        assert len(released["losses"]) >= 2 and released["losses"] == deferred["losses"]
        assert released["state"].keys() == deferred["state"].keys()
        for name, value in released["state"].items():
            assert torch.equal(value, deferred["state"][name]), name
