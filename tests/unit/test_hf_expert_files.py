"""Fused experts from transformers' per-expert files on one process (checkpoint/hf_expert_files.py): a
meta-built tiny Mixtral fills to exactly what ``from_pretrained`` loads, a piece of a fused tensor reads
only the runs overlapping it, and a directory lacking one expert's tensor is one error naming the fused
key. The 2-process layouts are in tests/multiprocess/test_moe_weights.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(120)


def _mixtral():
    torch.manual_seed(1)
    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM(config).float()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixtral")
    _mixtral().save_pretrained(directory)
    return str(directory)


def _meta(directory):
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config)


def test_a_meta_model_fills_to_from_pretrained(saved):
    from trainmesh._torch.materialize import materialize, prepare

    model = _meta(saved)
    materialize(model, prepare(model, saved), "cpu")
    want = transformers.AutoModelForCausalLM.from_pretrained(saved).state_dict()
    got = model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in got
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_piece_reads_only_the_runs_it_overlaps(saved):
    from trainmesh.checkpoint.hf_expert_files import with_fused_experts
    from trainmesh.checkpoint.safetensors_reader import WeightFiles

    model = _meta(saved)
    files = with_fused_experts(model, WeightFiles.open(saved))
    name = "model.layers.0.mlp.experts.gate_up_proj"  # (4 experts, 2 x 8, 16)
    reads = []
    original = WeightFiles.read_region
    WeightFiles.read_region = lambda self, n, *a, **k: reads.append(n) or original(self, n, *a, **k)
    try:
        piece = torch.empty(2, 3, 16)  # experts 1-2, rows 7-9: the last gate row and the first two up rows
        files.fill([(name, None, piece, (1, 7, 0), (2, 3, 16))])
    finally:
        WeightFiles.read_region = original
    prefix = "model.layers.0.block_sparse_moe.experts"  # Mixtral's legacy names: w1 gate, w3 up, w2 down
    assert sorted(set(reads)) == sorted(f"{prefix}.{e}.{w}.weight" for e in (1, 2) for w in ("w1", "w3"))
    full = transformers.AutoModelForCausalLM.from_pretrained(saved).state_dict()[name]
    assert torch.equal(piece, full[1:3, 7:10])


def test_a_missing_expert_tensor_is_one_error_naming_the_fused_key(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    from trainmesh._torch.materialize import prepare

    state = load_file(f"{saved}/model.safetensors")
    del state["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing key 'model\.layers\.0\.mlp\.experts\.gate_up_proj'"):
        prepare(_meta(saved), str(tmp_path))
