"""The Hugging Face layout in one process: ``tm.save_pretrained`` writes what transformers' own
``save_pretrained`` writes (same split, index and config), the streaming files read back with
safetensors, a failed commit leaves no entry point, and ``export_pretrained`` reads a DCP folder."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from trainmesh.checkpoint import hf_layout

pytestmark = pytest.mark.timeout(120)
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=8, bos_token_id=0, eos_token_id=1
    )
    return transformers.GPT2LMHeadModel(config)


def test_parse_size():
    assert hf_layout.parse_size("5GB") == 5 * 10**9
    assert hf_layout.parse_size("500MiB") == 500 * 2**20
    assert hf_layout.parse_size(1234) == 1234 and hf_layout.parse_size("4kb") == 4000
    for bad in ("five", 0, -3, "0GB", True, None):
        with pytest.raises(ValueError, match="max_shard_size"):
            hf_layout.parse_size(bad)


@pytest.mark.parametrize("shard", ["5GB", 20_000])
def test_same_files_as_transformers(tmp_path, shard):
    import trainmesh as tm

    model = _gpt2()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    tm.save_pretrained(model, ours, max_shard_size=shard)
    model.save_pretrained(theirs, max_shard_size=shard)
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    for name in names:
        if name.endswith(".json"):
            assert json.loads((ours / name).read_text()) == json.loads((theirs / name).read_text()), name
        else:
            a, b = safetensors_torch.load_file(ours / name), safetensors_torch.load_file(theirs / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # dtype= casts floating tensors on the way out, and says so in config.json
    tm.save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    loaded = safetensors_torch.load_file(tmp_path / "bf16" / "model.safetensors")
    assert {v.dtype for v in loaded.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_failed_commit_leaves_no_entry_point(tmp_path, monkeypatch):
    import trainmesh as tm

    model = _gpt2()
    tm.save_pretrained(model, tmp_path, max_shard_size=20_000)
    publish = hf_layout.publish

    def dies_before_the_index(staging, directory, name):
        if name == hf_layout.INDEX_NAME:
            raise OSError("killed (injected)")
        publish(staging, directory, name)

    monkeypatch.setattr(hf_layout, "publish", dies_before_the_index)
    with pytest.raises(RuntimeError, match="publishing"):
        tm.save_pretrained(model, tmp_path, max_shard_size=20_000)
    assert not (tmp_path / hf_layout.INDEX_NAME).exists() and not (tmp_path / hf_layout.WEIGHTS_NAME).exists()
    with pytest.raises(OSError):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_export_from_a_dcp_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    from trainmesh.checkpoint.hf_export import export_pretrained

    model = _gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    model.config.save_pretrained(tmp_path / "cfg")
    export_pretrained(tmp_path / "dcp", tmp_path / "out", config=tmp_path / "cfg" / "config.json")
    weights = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied: written once, as transformers does
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    with pytest.warns(RuntimeWarning, match="weights only"):  # no config anywhere: every tensor, no config.json
        export_pretrained(tmp_path / "dcp", tmp_path / "bare")
    assert set(safetensors_torch.load_file(tmp_path / "bare" / "model.safetensors")) == set(model.state_dict())
    assert not (tmp_path / "bare" / "config.json").exists()
    llama = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    llama.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="has no tensor 'model.embed_tokens.weight'"):
        export_pretrained(tmp_path / "dcp", tmp_path / "wrong", config=tmp_path / "other")
    assert not (tmp_path / "wrong" / hf_layout.WEIGHTS_NAME).exists()
