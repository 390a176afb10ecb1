"""ZeRO-3 LoRA: frozen units kept gathered between steps (``frozen_units.keep_between_steps``) change no number.

One launch of 2 gloo processes trains the tiny peft Llama of ``lora_cases`` under ``DataParallel(zero_stage=3)``
(the default ``keep_frozen_gathered="auto"``: kept), in fp32 and under bf16-mixed, two ways: as built (the
wholly frozen units gathered by the first forward and never again) and with every unit resharded after its
backward (FSDP2's default, so the frozen base is gathered again each step: the path before). Checked:

* every step's loss and every model tensor after the steps are bit-identical between the two, for a model
  whose adapters are replicated (lora_A frozen too: every kept unit wholly frozen) and for one whose adapters
  stay ZeRO-3 (only the blocks' base layers and the root's norm and head are kept between steps);
* a frozen weight loaded between steps through ``set_model_state_dict`` (the path a checkpoint load takes)
  reaches the next forward: FSDP2 reshards a unit before its state dict is loaded, so no stale gathered copy
  is used; the next step's loss equals the regathering run's with the same load, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed

from lora_cases import GLOBAL_BATCH, data, lm_loss, lora_model, make_optimizer

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
pytest.importorskip("transformers")
pytest.importorskip("peft")

EMBED = "base_model.model.model.embed_tokens.weight"
HEAD = "base_model.model.lm_head.weight"


def _model(replicated: bool) -> torch.nn.Module:
    model = lora_model("llama")
    if replicated:  # lora_A frozen too: adapters 5% of the frozen bytes, replicated (``replicated_grads.py``)
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad and "lora_A" not in name)
    return model


def _train(replicated: bool, precision: str, regather: bool) -> dict:
    import trainmesh as tm
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from trainmesh._torch.zero import fsdp_units

    trainer = tm.Trainer(
        _model(replicated),
        make_optimizer,
        lm_loss,
        distribution=tm.DataParallel(zero_stage=3),
        precision=precision,
        progress=False,
    )
    kept = trainer.model._trainmesh_memory["kept_between_steps"]
    if regather:  # FSDP2's default: every unit resharded after its backward, gathered again the next step
        for _, unit in fsdp_units(trainer.model):
            unit.set_reshard_after_backward(True, recurse=False)
    x, y = data()
    history = trainer.fit((x, y), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
    losses = [r["loss"] for r in history.steps]
    # a frozen weight changed between steps, loaded as a checkpoint would be (the head: kept between steps)
    head = get_model_state_dict(trainer.model)[HEAD]
    full = head.full_tensor() if hasattr(head, "full_tensor") else head
    changed = {HEAD: (full * 1.5).contiguous()}
    set_model_state_dict(trainer.model, changed, options=StateDictOptions(full_state_dict=True, strict=False))
    history = trainer.fit((x[:GLOBAL_BATCH], y[:GLOBAL_BATCH]), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
    after_load = history.steps[-1]["loss"]
    state = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in get_model_state_dict(trainer.model).items()
    }
    return {"kept": kept, "losses": losses, "after_load": after_load, "state": state}


def _run() -> dict:
    out = {}
    for replicated in (True, False):
        for precision in ("fp32", "bf16-mixed"):
            for regather in (False, True):
                out[(replicated, precision, regather)] = _train(replicated, precision, regather)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, world_size=2, timeout=280)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("replicated", [True, False], ids=["replicated", "zero3-adapters"])
def test_kept_between_steps_is_bit_identical_to_regathering(results, replicated, precision):
    for rank_result in results:
        kept, regathered = rank_result[(replicated, precision, False)], rank_result[(replicated, precision, True)]
        names = kept["kept"].split(", ")
        if replicated:  # every kept unit wholly frozen: the root and both blocks
            assert names == ["<root>", "base_model.model.model.layers.0", "base_model.model.model.layers.1"]
        else:  # the blocks' grouped base layers and the root's norm and head; the adapters' units not
            assert len(names) == 3 and not any(n.endswith(("layers.0", "layers.1")) for n in names), names
        assert len(kept["losses"]) >= 3
        assert kept["losses"] == regathered["losses"]
        assert kept["after_load"] == regathered["after_load"]
        assert kept["state"].keys() == regathered["state"].keys()
        for name, value in kept["state"].items():
            assert torch.equal(value, regathered["state"][name]), name
