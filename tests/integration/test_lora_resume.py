"""Trainable-only checkpoints of a LoRA fine-tune (issue 37, item 4): SIGKILL and resume.

One `trainmesh run -n 2 --max-restarts 2` launch of lora_resume_job.py kills a real rank in the
middle of a peft LoRA Llama run under DataParallel, then under ZeRO-3; torchrun's agent restarts
the job, which resumes from the checkpoint (adapters + their optimizer state, the base rebuilt
from the same weights) and ends with every model and optimizer tensor ``torch.equal`` to an
uninterrupted run. On disk the checkpoint holds no frozen tensor, and the marker says so.
The same checkpoint loads into other layouts (ZeRO-3, ZeRO-1, tensor parallel) and another
number of processes (here: one), and a model whose trainable set differs gets an error naming the tensor on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "lora_resume_job.py")
sys.path.insert(0, os.path.join(HERE, os.pardir, "multiprocess"))  # lora_cases, shared with the LoRA tests

from lora_cases import lora_model, make_optimizer  # noqa: E402

from trainmesh.checkpoint import CheckpointManager, integrity  # noqa: E402
from trainmesh._torch.dcp_reader import SafeFileSystemReader  # noqa: E402

KILL_AT, STEPS = 5, 12  # 6 steps per epoch: killed mid-epoch 0; saves every 2 steps and at each epoch end


def dcp_keys(checkpoint: str) -> set[str]:
    return set(SafeFileSystemReader(os.path.join(checkpoint, "dcp")).read_metadata().state_dict_metadata)


def dcp_bytes(checkpoint: str) -> int:
    root = os.path.join(checkpoint, "dcp")
    return sum(os.path.getsize(os.path.join(root, name)) for name in os.listdir(root))


def frozen_and_trainable() -> tuple[set[str], set[str]]:
    model = lora_model("llama")
    names = {name: p.requires_grad for name, p in model.named_parameters()}
    return {n for n, t in names.items() if not t}, {n for n, t in names.items() if t}


def newest(directory: str) -> str:
    return os.path.join(directory, sorted(n for n in os.listdir(directory) if n.startswith("step_"))[-1])


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_resume")
    cmd = [
        sys.executable,
        "-m",
        "trainmesh",
        "run",
        "-n",
        "2",
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.2",
        JOB,
        "--out",
        str(out),
        "--kill-at",
        str(KILL_AT),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    env.update(TRAINMESH_TIMEOUT_S="30", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return str(out)


def resume_points(root: str) -> dict[str, set[int]]:
    points: dict[str, set[int]] = {}
    for name in os.listdir(root):
        if name.startswith("samples.rank"):
            with open(os.path.join(root, name)) as fh:
                for parts in (line.split() for line in fh):
                    if parts and parts[0] == "RESUME":
                        points.setdefault(parts[1], set()).add(int(parts[2]))
    return points


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,attempt", [("dp", 0), ("zero3", 1)])
def test_lora_run_killed_mid_training_resumes_bit_identically(job, layout, attempt):
    root = os.path.join(job, layout)
    with open(os.path.join(root, "result.json")) as fh:
        result = json.load(fh)
    # Killed in attempt `attempt` after step 5, resumed mid-epoch by the next one from the newest sealed
    # checkpoint: 4, or 2 when the async step-4 save was not sealed yet when the kill struck.
    points = resume_points(root)
    assert points[f"{layout}-{attempt}"] == {0} and points[f"{layout}-{attempt + 1}"] <= {2, 4}, points
    assert len(points[f"{layout}-{attempt + 1}"]) == 1, points  # both processes at the same step
    assert result["attempt"] == attempt + 1
    assert any(k.startswith("optimizer/") for k in result["keys"])  # optimizer state compared too
    assert result["mismatched"] == [], result["mismatched"][:10]

    frozen, trainable = frozen_and_trainable()
    checkpoint, full = newest(os.path.join(root, "ckpt")), newest(os.path.join(root, "ref_ckpt"))
    keys = dcp_keys(checkpoint)
    model_keys = {k[len("model.") :] for k in keys if k.startswith("model.")}
    assert model_keys == trainable  # the adapters, and not one frozen tensor
    assert not {k for k in keys for name in frozen if name in k}
    marker = integrity.read_marker(checkpoint)["model_tensors"]
    assert marker["frozen_saved"] is False
    assert set(marker["saved"]) == trainable and set(marker["frozen_left_out"]) == frozen
    assert {k[len("model.") :] for k in dcp_keys(full) if k.startswith("model.")} == frozen | trainable
    # This model is tiny (hidden 32, r 4) and each DCP item has a fixed overhead: see
    # test_trainable_only_checkpoint_is_a_small_fraction for a proportion closer to real ones.
    assert dcp_bytes(checkpoint) < 0.8 * dcp_bytes(full)


@pytest.mark.timeout(300)
def test_trainable_only_checkpoint_loads_into_other_layouts_and_refuses_a_different_trainable_set(job):
    final = torch.load(os.path.join(job, "dp", "final.pt"))  # model/NAME and optimizer/NAME/KEY
    for layout in ("zero3", "zero1", "tp"):
        loaded = torch.load(os.path.join(job, f"dp_into_{layout}.pt"))
        assert final.keys() == loaded.keys(), layout
        for name, value in final.items():
            assert torch.equal(loaded[name], value), (layout, name)  # adapters loaded, base rebuilt: the same

    # Two ZeRO-3 processes' shards into one process, without a Trainer.
    final = {
        k[len("model/") :]: v
        for k, v in torch.load(os.path.join(job, "zero3", "final.pt")).items()
        if k.startswith("model/")
    }
    model = lora_model("llama")
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    with torch.random.fork_rng():  # the load restores the saved RNG state: keep pytest's own
        CheckpointManager(os.path.join(job, "zero3", "ckpt")).load("latest", {"model": model, "optimizer": optimizer})
    state = model.state_dict()
    for name, value in final.items():
        assert torch.equal(state[name], value), name
    assert len(optimizer.state) == len(frozen_and_trainable()[1])

    reports = []
    for rank in (0, 1):
        with open(os.path.join(job, f"mismatch.rank{rank}.json")) as fh:
            reports.append(json.load(fh))
    assert reports[0]["loaded"] == {layout: [True, STEPS] for layout in ("zero3", "zero1", "tp")}
    assert reports[0]["error"] is not None and reports[0]["error"] == reports[1]["error"]
    assert "embed_tokens.weight" in reports[0]["error"] and "(rank 1)" in reports[0]["error"]


@pytest.mark.timeout(120)
def test_trainable_only_checkpoint_is_a_small_fraction(tmp_path):
    """A LoRA r=8 on a Llama of hidden 512 (1/64 of the width, still far above real proportions):
    the checkpoint with AdamW state against the one with the frozen base."""
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=16,
    )
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config),
        peft.LoraConfig(
            r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        ),
    )
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()  # AdamW state exists
    with torch.random.fork_rng():
        small = CheckpointManager(tmp_path / "lora").save(1, {"model": model, "optimizer": optimizer})
        full = CheckpointManager(tmp_path / "full", save_frozen=True).save(1, {"model": model, "optimizer": optimizer})
    ratio = dcp_bytes(small) / dcp_bytes(full)
    print(f"trainable-only / full checkpoint bytes: {ratio:.3f}")
    assert ratio < 0.15
    assert not any("base_layer" in k or "embed_tokens" in k for k in dcp_keys(small))


@pytest.mark.timeout(120)
def test_adapters_are_not_loaded_onto_another_frozen_base(tmp_path):
    """The marker's fingerprint of the frozen base (a sum and a sum of squares per tensor): loading onto
    a base from another seed, or with one element of one frozen weight changed, is refused by name."""
    model = lora_model("llama")
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    with torch.random.fork_rng():
        CheckpointManager(tmp_path / "ckpt").save(1, {"model": model, "optimizer": optimizer})
    fingerprint = integrity.read_marker(newest(str(tmp_path / "ckpt")))["model_tensors"]["frozen_fingerprint"]
    assert set(fingerprint) == frozen_and_trainable()[0]

    other = lora_model("llama", seed=7)
    with pytest.raises(ValueError, match="another frozen base: .*embed_tokens.weight"):
        CheckpointManager(tmp_path / "ckpt").load("latest", {"model": other})
    nudged = lora_model("llama")
    name = "base_model.model.model.layers.1.mlp.down_proj.base_layer.weight"
    with torch.no_grad():
        nudged.get_parameter(name)[3, 5] += 1e-3
    with pytest.raises(ValueError, match=f"another frozen base: {name.replace('.', '[.]')} differ"):
        CheckpointManager(tmp_path / "ckpt").load("latest", {"model": nudged})
    same = lora_model("llama")
    with torch.random.fork_rng():
        CheckpointManager(tmp_path / "ckpt").load("latest", {"model": same})  # the same base loads


@pytest.mark.timeout(120)
def test_the_frozen_base_is_fingerprinted_once_per_saver(tmp_path, monkeypatch):
    """A pass over the whole frozen base at every save would hold training each time; it does not train."""
    from trainmesh._torch import trainable_state

    calls = []
    real = trainable_state.frozen_fingerprint
    monkeypatch.setattr(trainable_state, "frozen_fingerprint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = lora_model("llama")
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    manager = CheckpointManager(tmp_path / "ckpt")
    with torch.random.fork_rng():
        for step in (1, 2, 3):
            manager.save(step, {"model": model, "optimizer": optimizer})
    assert len(calls) == 1
    markers = [integrity.read_marker(os.path.join(tmp_path / "ckpt", f"step_{s:08d}")) for s in (1, 2, 3)]
    assert all(
        m["model_tensors"]["frozen_fingerprint"] == markers[0]["model_tensors"]["frozen_fingerprint"] for m in markers
    )
