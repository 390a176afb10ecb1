"""examples/finetune_lora.py end to end, under ``trainmesh run`` on 2 processes: a local Hugging Face
checkpoint (a tiny Llama with its own tokenizer, saved here) and a text file or a token-shard
directory in; peft adapters out that ``PeftModel.from_pretrained`` loads, and a merged model equal
to peft's own ``merge_and_unload``. The same tokens under ZeRO-3 (text file), tensor parallelism
(token shards) and a 2-stage pipeline train the same adapters."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.timeout(600)]
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "finetune_lora.py")
WORDS = "the a model trains adapters on frozen weights while every process reads only its own shard of the base".split()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    import tokenizers

    root = tmp_path_factory.mktemp("finetune")
    text = " ".join(WORDS[(i * 7 + i // 3) % len(WORDS)] for i in range(2000))
    vocab = {"[UNK]": 0}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    base = root / "base"
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    fast.save_pretrained(base)
    (root / "corpus.txt").write_text(text)
    import trainmesh as tm

    tm.data.write_token_shards([fast(text)["input_ids"]], root / "shards", vocab_size=32, shard_tokens=1000)
    return root


def run(root, nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    launcher = [sys.executable, "-m", "trainmesh", "run", "-n", str(nproc)] if nproc > 1 else [sys.executable]
    cmd = [
        *launcher,
        EXAMPLE,
        "--base",
        str(root / "base"),
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--block",
        "16",
        "--rank",
        "4",
        "--targets",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, cwd=root)


def final_loss(done: subprocess.CompletedProcess) -> float:
    return float(re.search(r"final loss ([0-9.]+)", done.stdout).group(1))


def adapters(root, directory: str) -> dict:
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(root / "base"), root / directory
    )
    return model, {k: v for k, v in model.state_dict().items() if "lora_" in k}


def test_text_under_zero3_and_shards_under_tp_give_the_same_adapters_peft_loads(inputs):
    root = inputs
    first = run(root, 2, "--layout", "fsdp", "--data", "corpus.txt", "--out", "zero3", "--merge", "merged")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "parameters trained, 3 steps" in first.stdout
    assert sorted(os.listdir(root / "zero3")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert os.listdir(root / "zero3-checkpoints")  # the training checkpoints sit beside the adapters
    second = run(root, 2, "--layout", "tp", "--data", "shards", "--out", "tp")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    third = run(root, 2, "--layout", "pp", "--data", "corpus.txt", "--out", "pp")  # 2 stages, meta-built base
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]

    model, zero3 = adapters(root, "zero3")
    _, tp = adapters(root, "tp")
    _, pp = adapters(root, "pp")
    assert len(zero3) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    # lora_B starts at zero (peft's default): it moved, so the adapters were trained, not just saved
    assert all(v.abs().max() > 0 for k, v in zero3.items() if "lora_B" in k)
    for name, value in zero3.items():  # fp32, the same tokens and batches, another layout and data path
        assert (value - tp[name]).abs().max().item() <= 1e-5, name
        assert (value - pp[name]).abs().max().item() <= 1e-5, name
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged").state_dict()
    for name, value in model.merge_and_unload().state_dict().items():
        assert (merged[name] - value).abs().max().item() <= 1e-6, name


def test_a_bf16_base_trains_fp32_adapters(inputs):
    root = inputs
    done = run(root, 2, "--layout", "fsdp", "--data", "corpus.txt", "--out", "bf16", "--base-dtype", "bf16")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "precision bf16-mixed" in done.stdout + done.stderr
    from safetensors.torch import load_file

    saved = load_file(root / "bf16" / "adapter_model.safetensors")
    assert saved and all(v.dtype == torch.float32 for v in saved.values())  # peft keeps adapters in fp32
    assert all(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # trained from zero
    _, loaded = adapters(root, "bf16")
    assert len(loaded) == len(saved)
    # The pipeline computes the loss under autocast as every other layout does: it ran in bf16 on the
    # bf16 logits (3.468750, a bf16 number, against 3.471236), now within bf16 compute noise (~1e-4)
    piped = run(root, 2, "--layout", "pp", "--data", "corpus.txt", "--out", "bf16-pp", "--base-dtype", "bf16")
    assert piped.returncode == 0, piped.stdout[-3000:] + piped.stderr[-3000:]
    assert abs(final_loss(piped) - final_loss(done)) < 5e-4, (final_loss(piped), final_loss(done))


def test_a_target_module_the_model_lacks_is_named(inputs):
    done = run(inputs, 1, "--data", "corpus.txt", "--out", "bad", "--targets", "q_proj,v_projj")
    assert done.returncode != 0
    assert "['v_projj'] are not in the model" in done.stderr, done.stderr[-2000:]
