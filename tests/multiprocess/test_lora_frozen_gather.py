"""ZeRO-3 over a frozen LoRA base: ``keep_frozen_gathered`` gathers the base once, not twice a step.

One launch of 2 gloo processes trains the tiny peft LoRA Llama of ``lora_cases`` under
``DataParallel(zero_stage=3, keep_frozen_gathered=...)`` with the option on and off, and checks:

* the all-gather bytes of one step, counted at the dispatcher (``CollectiveCounter``: the full
  buffer of each c10d call, over 3 steps): with the option on, the frozen base once in all (its wholly
  frozen units stay gathered between steps; the released input embedding once a step) and the adapters
  twice a step (r=4 adapters are 22% of this tiny base: the blocks keep only their base layers gathered);
  with lora_A frozen too (the model is then mostly frozen) the adapters are replicated, their gradients one
  flat all-reduce a step, and the frozen base is gathered once in all, the adapters never; off, everything twice. Equal within 1% (FSDP2 pads each parameter to the world size);
* parity: every tensor after 3 AdamW steps equals a plain one-process peft loop (fp32, 1e-5), all three
  ways, and the frozen base is unchanged;
* the frozen input embedding is its own unit, gathered for its forward only: the gathered bytes alive when
  the loss is computed (between forward and backward) are the kept groups and the root without it, and
  its all-gather happens once a step (none in backward), all three ways;
* the choice is reported in ``_trainmesh_memory``; a wrong value is refused before any collective.
"""

from __future__ import annotations

import pytest
import torch

from trainmesh._torch.frozen_units import MOSTLY_FROZEN
from trainmesh.testing import run_distributed

from lora_cases import GLOBAL_BATCH, STEPS, data, lm_loss, lora_model, make_optimizer, reference, train_reference

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
pytest.importorskip("transformers")
pytest.importorskip("peft")


def _sizes(model: torch.nn.Module) -> dict:
    """fp32 bytes of the blocks' frozen parameters, the blocks' adapters, and the rest (the root's), and of
    the input embedding (a part of the root's)."""
    out = {"frozen_blocks": 0, "adapters": 0, "root": 0}
    for name, p in model.named_parameters():
        key = "root" if ".layers." not in name else ("adapters" if p.requires_grad else "frozen_blocks")
        out[key] += p.numel() * 4
    out["embedding"] = model.get_input_embeddings().weight.numel() * 4
    return out


def _gathered_bytes(model: torch.nn.Module) -> int:
    """Bytes of FSDP2 all-gather outputs alive now (a resharded unit's are freed to size 0)."""
    from trainmesh._torch.zero import fsdp_units

    return sum(
        t.untyped_storage().nbytes()
        for _, unit in fsdp_units(model)
        for group in unit._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
        for t in getattr(fsdp_param, "all_gather_outputs", None) or []
    )


def _run(keep_values) -> dict:
    import trainmesh as tm
    from trainmesh.planner.collectives import CollectiveCounter, CollectiveLog

    class CallLog(CollectiveLog):
        def add(self, axis, kind, nbytes, count=1):
            super().add(axis, kind, nbytes, count)
            self.calls = getattr(self, "calls", []) + [(kind, int(nbytes))]

    out = {}
    for keep in keep_values:
        model = lora_model("llama")
        if keep == "whole":  # lora_A frozen too: trainable bytes 5% of the frozen, the blocks kept whole
            for name, p in model.named_parameters():
                p.requires_grad_(p.requires_grad and "lora_A" not in name)
        sizes = _sizes(model)
        sizes["count"] = sum(p.requires_grad for p in model.parameters())
        at_loss: list[int] = []  # gathered bytes between forward and backward, each step

        def loss_fn(outputs, targets):
            at_loss.append(_gathered_bytes(trainer.model))
            return lm_loss(outputs, targets)

        trainer = tm.Trainer(
            model,
            make_optimizer,
            loss_fn,
            distribution=tm.DataParallel(zero_stage=3, keep_frozen_gathered=keep == "whole" or keep),
            progress=False,
        )
        log = CallLog()
        with CollectiveCounter({}, log=log):
            trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
        calls = getattr(log, "calls", [])
        gathered = sum(n for kind, n in calls if kind == "all_gather") / STEPS
        state = trainer.state_dict()["model"]
        out[keep] = {
            "sizes": sizes,
            "gathered_per_step": gathered,
            "gathered_at_loss": at_loss,
            "broadcasts": sum(kind == "broadcast" for kind, _ in calls),
            # gradient collectives: reduce-scatters, and all-reduces above the Trainer's few-byte loss and flags
            "grad_calls": [
                (kind, n) for kind, n in calls if kind == "reduce_scatter" or (kind == "all_reduce" and n > 64)
            ],
            "memory": dict(getattr(trainer.model, "_trainmesh_memory", {})),
            "state": {k: v.detach().clone() for k, v in state.items()},
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, world_size=2, args=([True, False, "whole"],), timeout=280), reference("llama")


def test_frozen_base_gathered_once_per_step_when_kept(results):
    got, _ = results
    for rank_result in got:
        on, off = rank_result[True], rank_result[False]
        sizes = on["sizes"]
        assert sizes["frozen_blocks"] > 3 * sizes["adapters"] > 0
        # r=4 adapters on a 32-wide model are 22% of its base (> MOSTLY_FROZEN): only the base layers kept
        assert sizes["adapters"] > MOSTLY_FROZEN * sizes["frozen_blocks"]
        # kept, the wholly frozen groups (the blocks' base layers, the root's norm and head) are gathered by the
        # first forward only and stay gathered between steps (``keep_between_steps``); the released input
        # embedding once a step, the ZeRO-3 adapters twice a step
        once = sizes["root"] - sizes["embedding"] + sizes["frozen_blocks"]
        expected_on = once / STEPS + sizes["embedding"] + 2 * sizes["adapters"]
        # the root (embedding, norm, head) stays gathered from forward to backward either way (``zero.py``)
        expected_off = sizes["root"] + 2 * (sizes["frozen_blocks"] + sizes["adapters"])
        assert on["gathered_per_step"] == pytest.approx(expected_on, rel=0.01), (on["gathered_per_step"], sizes)
        assert off["gathered_per_step"] == pytest.approx(expected_off, rel=0.01), (off["gathered_per_step"], sizes)
        # lora_A frozen too: the model is mostly frozen (adapters at most MOSTLY_FROZEN of the frozen bytes), so
        # the adapters are replicated, never gathered, and every unit is kept whole: the frozen base once in all
        # (the first forward), the released embedding once a step
        whole = rank_result["whole"]
        ws = whole["sizes"]
        assert ws["adapters"] <= MOSTLY_FROZEN * (ws["frozen_blocks"] + ws["root"])
        expected_whole = (ws["frozen_blocks"] + ws["root"] - ws["embedding"]) / STEPS + ws["embedding"]
        assert whole["gathered_per_step"] == pytest.approx(expected_whole, rel=0.01), whole["gathered_per_step"]
        # their gradients: one flat all-reduce per step (the adapters and a flag each), no reduce-scatter
        assert [kind for kind, _ in whole["grad_calls"]] == ["all_reduce"] * STEPS, whole["grad_calls"]
        assert whole["sizes"]["adapters"] <= whole["grad_calls"][0][1] < whole["sizes"]["adapters"] + 1024
        assert whole["broadcasts"] == 0  # stepped whole on every process, not partitioned and broadcast (ZeRO-1)
        assert whole["memory"]["replicated_trainables"].startswith(f"{whole['sizes']['count']} parameters"), whole[
            "memory"
        ]
        assert on["memory"]["replicated_trainables"] == "none"  # 18% of the frozen bytes: adapters stay ZeRO-3
        assert sum(kind == "reduce_scatter" for kind, _ in on["grad_calls"]) == 2 * STEPS  # one per block
        assert on["memory"]["keep_frozen_gathered"].startswith("on (3 units")
        assert whole["memory"]["kept_between_steps"].split(", ") == [
            "<root>",
            "base_model.model.model.layers.0",
            "base_model.model.model.layers.1",
        ], whole["memory"]
        assert len(on["memory"]["kept_between_steps"].split(", ")) == 3  # the two blocks' base layers, the root's
        assert off["memory"]["kept_between_steps"] == "none"
        assert off["memory"]["keep_frozen_gathered"].startswith("off (keep_frozen_gathered=False")


def test_frozen_embedding_released_after_forward(results):
    """Between forward and backward (at the loss) the gathered bytes are the kept groups and the root without
    the input embedding: it was freed after its forward (left in the root, it stayed gathered to the end of
    backward). And it is never gathered in backward: the all-gather bytes a step above count it once."""
    got, _ = results
    for rank_result in got:
        for keep, run in rank_result.items():
            sizes = run["sizes"]
            root_rest = sizes["root"] - sizes["embedding"]  # the final norm and the head
            kept_blocks = 0 if keep is False else sizes["frozen_blocks"]
            assert len(run["gathered_at_loss"]) >= STEPS  # the Trainer's first call may be a probe outside a step
            for nbytes in run["gathered_at_loss"][-STEPS:]:
                assert nbytes == pytest.approx(root_rest + kept_blocks, rel=0.01), (keep, nbytes, sizes)
            assert run["memory"]["released_after_forward"].endswith("embed_tokens"), run["memory"]


def test_parity_with_one_process_either_way(results):
    got, expected = results
    start = lora_model("llama").state_dict()
    for keep in (True, False):
        state = got[0][keep]["state"]
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            diff = (state[name] - value).abs().max().item()
            assert diff <= 1e-5, f"keep_frozen_gathered={keep}: {name} differs from one process by {diff:.3g}"
            if "lora_" not in name:
                assert torch.equal(state[name], start[name]), f"frozen {name} changed"
    # the replicated adapters (lora_B; lora_A frozen) against one process with the same ones frozen
    model = lora_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_(p.requires_grad and "lora_A" not in name)
    expected = train_reference(model)
    state = got[0]["whole"]["state"]
    moved = max((expected[k] - start[k]).abs().max().item() for k in expected if "lora_B" in k)
    assert moved > 1e-3  # the adapters trained
    for name, value in expected.items():
        diff = (state[name] - value).abs().max().item()
        assert diff <= 1e-5, f"replicated adapters: {name} differs from one process by {diff:.3g}"


def test_bad_value_refused_by_name():
    import trainmesh as tm

    with pytest.raises(ValueError, match="keep_frozen_gathered must be True, False or 'auto'.*Received"):
        tm.DataParallel(devices=["cpu:0", "cpu:1"], zero_stage=3, keep_frozen_gathered="yes")
    with pytest.raises(ValueError, match="keep_frozen_gathered"):
        tm.DataParallel(devices=["cpu:0", "cpu:1"], zero_stage=3, keep_frozen_gathered=1)


def test_planner_counts_the_kept_base_and_says_so():
    """One process, the planner's fake process group: at stage 3 the kept frozen groups count whole in
    ``buffers`` (the root's and both blocks' base: held from forward to backward), and the row says so."""
    import trainmesh as tm

    sizes = _sizes(lora_model("llama"))
    report = tm.plan(lambda: lora_model("llama"), world_size=2, zero_stage=3, micro_batch=2, seq_len=16)
    row = report.rows[0]
    assert row.buffers >= sizes["root"] + sizes["frozen_blocks"], (row.buffers, sizes)
    assert any(note.startswith("frozen units kept gathered from forward to backward: on (auto") for note in row.notes)
