"""ZeRO-3 LoRA with the adapters replicated (a mostly frozen model: ``frozen_units.replicated_trainables``).

The default path for a peft LoRA model under ``zero_stage=3``: FSDP2 leaves the adapters out, every
process holds them whole and ``replicated_grads.FlatGradAllReduce`` averages their gradients with one
flat all-reduce per backward. The tiny peft Llama of ``lora_cases`` with lora_A frozen too (trainable
bytes 5% of the frozen) takes it. One launch of 2 gloo processes checks, against one process in fp32:

* the path is taken: the memory line says so, the adapters are plain tensors (the base DTensor shards),
  stepped whole by fused AdamW (not a ZeroRedundancyOptimizer) under ``Trainer(zero_stage=3)``;
* accumulation 2 + clipping (max norm 0.03, below every step's norm): one reduction per micro-step,
  each step's gradient norm and the adapters after 3 AdamW steps within 1e-5 of one process;
* gradients of one backward, uncompressed and with ``compression="fp16"`` and ``"int8"`` (the two
  branches of the compressed reduce-scatter the flat buffer goes through): a parameter with no gradient on
  rank 0 only gets rank 1's half, one with no gradient anywhere stays None, the rest the mean; fp32
  within 1e-6, fp16 within its rounding (2^-11 of each rank's value and of their sum), int8 within its
  quantisation step (each rank's largest magnitude / 254), neither bit-equal to fp32;
* two trainable dtypes (a bf16 norm weight beside the fp32 adapters) through int8 with error feedback:
  two flat buffers, each under its own residual key;
* resume: a ``ShardedCheckpoint`` after step 2 loaded by a fresh Trainer, which trains step 3: every
  model and optimizer tensor bit-identical to the 3 uninterrupted steps; the same checkpoint loaded
  on 1 process (plain Trainer) gives equal adapters and optimizer moments;
* ``tm.save_pretrained`` writes the adapters peft writes from one process (keys, values within 1e-5).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from trainmesh.testing import run_distributed

from lora_cases import GLOBAL_BATCH, STEPS, data, lm_loss, lora_model, make_optimizer

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
pytest.importorskip("transformers")
pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

WORLD, ACCUM, MAX_NORM = 2, 2, 0.03
PREFIX = "base_model.model.model.layers."
PART = PREFIX + "0.self_attn.q_proj.lora_B.default"  # no gradient on rank 0 (its output detached there)
NONE = PREFIX + "1.self_attn.v_proj.lora_B.default"  # no gradient on any process
COMPRESSIONS = [None, "fp16", "int8"]  # int8: all-to-all of quantised rows; fp16: a reduce-scatter in fp16


def whole_model() -> torch.nn.Module:
    """lora_cases' peft Llama with lora_A frozen too: the adapters are then 5% of the frozen bytes."""
    model = lora_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_(p.requires_grad and "lora_A" not in name)
    return model


def local_grads(model: torch.nn.Module, rank: int) -> dict:
    """One backward over ``rank``'s 4 rows of the first batch, with rank 0's and everyone's detached
    outputs (the same hooks on one process and under the Trainer)."""
    detached = [NONE] + ([PART] if rank == 0 else [])
    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_hook(lambda m, i, out: out.detach()) for n in detached]
    x, y = data()
    rows = slice(rank * GLOBAL_BATCH // WORLD, (rank + 1) * GLOBAL_BATCH // WORLD)
    lm_loss(model(x[rows]), y[rows]).backward()
    for handle in handles:
        handle.remove()
    return {
        n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters() if p.requires_grad
    }


def _full_state(trainer) -> dict:
    state = trainer.state_dict()  # collective
    tensors = {f"model/{k}": v.detach().clone() for k, v in state["model"].items() if "lora_" in k}
    for name, entry in state["optimizer"].get("state", {}).items():
        tensors.update({f"optimizer/{name}/{k}": v.clone() for k, v in entry.items() if torch.is_tensor(v)})
    return tensors


def _trainer(checkpoint=None, model=None, **options):
    import trainmesh as tm

    return tm.Trainer(
        model if model is not None else whole_model(),
        make_optimizer,
        lm_loss,
        zero_stage=3,
        grad_accum_steps=ACCUM,
        max_grad_norm=MAX_NORM,
        callbacks=[checkpoint] if checkpoint is not None else [],
        progress=False,
        **options,
    )


def _run(root: str) -> dict:
    import trainmesh as tm
    from torch.distributed.tensor import DTensor

    rank = tm.rank()
    out = {}
    # 3 steps uninterrupted, a checkpoint after step 2 (and at the epoch's end, step 3)
    trainer = _trainer(tm.ShardedCheckpoint(os.path.join(root, "run"), every_n_steps=2, async_save=False))
    history = trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
    params = dict(trainer.model.named_parameters())
    out["memory"] = dict(trainer.model._trainmesh_memory)
    out["trainable"] = sum(p.requires_grad for p in params.values())
    out["plain_trainable"] = sorted(n for n, p in params.items() if p.requires_grad and not isinstance(p, DTensor))
    out["dtensor_frozen"] = sum(isinstance(p, DTensor) for p in params.values() if not p.requires_grad)
    out["reductions"] = trainer.model._trainmesh_replicated_grads.calls
    out["optimizer"] = (type(trainer.optimizer).__name__, all(g.get("fused") for g in trainer.optimizer.param_groups))
    out["grad_norms"] = [r.get("grad_norm") for r in history.steps]
    out["uninterrupted"] = _full_state(trainer)
    tm.save_pretrained(trainer.model, os.path.join(root, "adapters"))
    tm.barrier()
    if rank == 0:  # the step-2 checkpoint alone in a directory of its own: the newest there
        for copy in ("step2", "step2_one"):  # the resumed run saves its step 3 into the first
            shutil.copytree(os.path.join(root, "run", "step_00000002"), os.path.join(root, copy, "step_00000002"))
    tm.barrier()
    checkpoint = tm.ShardedCheckpoint(os.path.join(root, "step2"), async_save=False, keep_last=5)
    trainer = _trainer(checkpoint)
    assert checkpoint.resume()
    out["at_step2"] = _full_state(trainer)
    trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False, resume=True)
    out["resumed_steps"] = trainer.global_step
    out["resumed"] = _full_state(trainer)
    # one backward, its gradients as the optimizer would get them, uncompressed and compressed
    for compression in COMPRESSIONS:
        trainer = _trainer(compression=compression)
        flat = trainer.model._trainmesh_replicated_grads
        out[f"grads_{compression}"] = local_grads(trainer.model, rank)
        out[f"compressed_{compression}"] = flat._compressed(torch.float32) is not None
        out[f"calls_{compression}"] = flat.calls
    # two trainable dtypes (the root's norm weight made trainable, in bf16: its ones are exact there, so the
    # forward is unchanged) through int8 with error feedback: two flat buffers, each under its own residual key
    from trainmesh.compression.int8 import Int8Compressor

    model = whole_model()
    norm = model.base_model.model.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().to(torch.bfloat16))
    trainer = _trainer(model=model, compression=Int8Compressor(error_feedback=True))
    flat = trainer.model._trainmesh_replicated_grads
    for _ in range(2):  # the second backward adds the first's residuals
        trainer.model.zero_grad(set_to_none=True)
        grads = local_grads(trainer.model, rank)
    out["grads_mixed"], out["calls_mixed"] = grads, flat.calls
    out["residual_keys"] = sorted(trainer.communication.compressor.residuals)
    return out


def _load_on_one_process(root: str) -> dict:
    import trainmesh as tm

    model = whole_model()
    checkpoint = tm.ShardedCheckpoint(os.path.join(root, "step2_one"), async_save=False)
    trainer = tm.Trainer(model, make_optimizer, lm_loss, callbacks=[checkpoint], grad_accum_steps=ACCUM, progress=False)
    assert checkpoint.resume()
    return {"at_step2": _full_state(trainer), "step": trainer.global_step}


def _reference() -> dict:
    """3 steps on one process: 2 micro-batches of 4 rows a step (loss / 2 each), clipped, AdamW."""
    model = whole_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params)
    x, y = data()
    norms = []
    micro = GLOBAL_BATCH // ACCUM
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(ACCUM):
            rows = slice(step * GLOBAL_BATCH + k * micro, step * GLOBAL_BATCH + (k + 1) * micro)
            (lm_loss(model(x[rows]), y[rows]) / ACCUM).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
    return {"model": model, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora_replicated"))
    got = run_distributed(_run, world_size=WORLD, args=(root,), timeout=280)
    one = run_distributed(_load_on_one_process, world_size=1, args=(root,), timeout=120)[0]
    return root, got, one, _reference()


def test_the_replicated_path_is_taken(results):
    _, got, _, _ = results
    for r in got:
        assert r["memory"]["replicated_trainables"].startswith(f"{r['trainable']} parameters"), r["memory"]
        assert len(r["plain_trainable"]) == r["trainable"] > 0  # every adapter a plain tensor, whole
        assert r["dtensor_frozen"] > 0  # the frozen base stays sharded
        assert r["reductions"] == STEPS * ACCUM  # one flat all-reduce per micro-step's backward
        # stepped whole with fused AdamW (Trainer(zero_stage=3) over a stage-0 DataParallel wrapped them in a
        # ZeroRedundancyOptimizer: partitioned, broadcast after every step)
        assert r["optimizer"] == ("AdamW", True), r["optimizer"]


def test_accumulation_and_clipping_match_one_process(results):
    _, got, _, ref = results
    assert min(ref["norms"]) > 2 * MAX_NORM  # every step clips
    for r in got:
        assert r["grad_norms"] == pytest.approx(ref["norms"], rel=1e-5)
    start = whole_model().state_dict()
    state = got[0]["uninterrupted"]
    moved = 0.0
    for name, value in ref["state"].items():
        if "lora_B" not in name:
            continue
        diff = (state[f"model/{name}"] - value).abs().max().item()
        assert diff <= 1e-5, f"{name} differs from one process by {diff:.3g}"
        moved = max(moved, (value - start[name]).abs().max().item())
    assert moved > 1e-3  # the adapters trained


def _expected_grads():
    per_rank = [local_grads(whole_model(), rank) for rank in range(WORLD)]
    expected = {}
    for name in per_rank[0]:
        present = [g[name] for g in per_rank if g[name] is not None]
        expected[name] = None if not present else sum(present) / WORLD  # a missing gradient counts as zeros
    return per_rank, expected


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_gradients_with_missing_ones(results, compression):
    _, got, _, _ = results
    per_rank, expected = _expected_grads()
    amax = [max(v.abs().max().item() for v in g.values() if v is not None) for g in per_rank]
    assert expected[NONE + ".weight"] is None and per_rank[0][PART + ".weight"] is None
    for r in got:
        grads = r[f"grads_{compression}"]
        assert r[f"compressed_{compression}"] == (compression is not None)
        assert r[f"calls_{compression}"] == 1
        assert grads.keys() == expected.keys()
        for name, value in expected.items():
            if value is None:
                assert grads[name] is None, f"{name}: no process had a gradient, yet it got one"
                continue
            diff = (grads[name] - value).abs()
            if compression is None:
                assert diff.max().item() <= 1e-6, f"{name} differs from one process by {diff.max().item():.3g}"
            elif compression == "fp16":  # each rank's value and their sum (reduce-scattered in fp16) rounded
                parts = [g[name].abs() for g in per_rank if g[name] is not None]
                bound = 2.0**-10 * sum(parts) / WORLD + 1e-7
                assert bool((diff <= bound).all()), f"{name}: {(diff - bound).max().item():.3g} beyond fp16 rounding"
            else:  # int8: each rank's row quantised to 1/254 of its block's largest magnitude, summed in fp32
                bound = sum(amax) / 254 / WORLD + 1e-7
                assert diff.max().item() <= bound, f"{name}: {diff.max().item():.3g} beyond int8's step {bound:.3g}"
    # the same values on both processes (a replicated parameter must stay replicated)
    for name in expected:
        a, b = got[0][f"grads_{compression}"][name], got[1][f"grads_{compression}"][name]
        assert (a is None and b is None) or torch.equal(a, b), name
    if compression is not None:  # the adapters really went through the compressor
        exact = got[0]["grads_None"]
        assert any(
            not torch.equal(exact[n], got[0][f"grads_{compression}"][n]) for n in expected if expected[n] is not None
        )


def test_two_trainable_dtypes_through_int8_with_error_feedback(results):
    """Two flat buffers (fp32 adapters, a bf16 norm weight), each under its own residual key: borrowing the
    root unit's reduce-scatter gave both one key, and the second shape was refused at the first backward."""
    _, got, _, _ = results
    per_rank, expected = _expected_grads()
    amax = [max(v.abs().max().item() for v in g.values() if v is not None) for g in per_rank]
    norm = "base_model.model.model.norm.weight"
    for r in got:
        assert r["calls_mixed"] == 2 * 2  # two backwards, two dtypes each
        assert r["residual_keys"] == sorted(
            f"<replicated {dtype}>/shard {j} of {WORLD}"
            for dtype in ("torch.float32", "torch.bfloat16")
            for j in range(WORLD)
        )
        grads = r["grads_mixed"]
        assert grads[norm] is not None and grads[norm].dtype == torch.bfloat16
        assert grads[NONE + ".weight"] is None
        # the second backward (zero_grad before it) sends its gradient plus the first's residual and keeps
        # its own: each rank's value within two quantisation steps (of a corrected amax a little larger)
        bound = 1.01 * sum(amax) / 127 / WORLD + 1e-7
        for name, value in expected.items():
            if value is not None:
                assert (grads[name] - value).abs().max().item() <= bound, name
    assert torch.equal(got[0]["grads_mixed"][norm], got[1]["grads_mixed"][norm])


def test_resume_is_bit_identical_and_loads_on_one_process(results):
    _, got, one, _ = results
    for r in got:
        assert r["resumed_steps"] == STEPS
        assert r["resumed"].keys() == r["uninterrupted"].keys()
        mismatched = [k for k, v in r["uninterrupted"].items() if not torch.equal(v, r["resumed"][k])]
        assert mismatched == [], mismatched
    assert one["step"] == 2
    loaded, at_step2 = one["at_step2"], got[0]["at_step2"]
    assert loaded.keys() == at_step2.keys() and any(k.startswith("optimizer/") for k in loaded)
    mismatched = [k for k, v in at_step2.items() if not torch.equal(v, loaded[k])]
    assert mismatched == [], mismatched
    # and step 2 is not step 3: the resumed run really trained on
    assert not torch.equal(at_step2["model/" + PART + ".weight"], got[0]["resumed"]["model/" + PART + ".weight"])


def test_save_pretrained_writes_one_process_adapters(results, tmp_path):
    root, _, _, ref = results
    ref["model"].save_pretrained(str(tmp_path / "ref"))  # peft's own writer, one process
    expected = safetensors_torch.load_file(str(tmp_path / "ref" / "adapter_model.safetensors"))
    written = safetensors_torch.load_file(os.path.join(root, "adapters", "adapter_model.safetensors"))
    assert written.keys() == expected.keys() and expected
    for name, value in expected.items():
        diff = (written[name] - value).abs().max().item()
        assert diff <= 1e-5, f"{name} differs from one process's by {diff:.3g}"
    assert os.path.exists(os.path.join(root, "adapters", "adapter_config.json"))
