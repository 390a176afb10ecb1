"""``save_pretrained``'s in-place writes take turns: process p writes its runs of file (p + k) mod F
at its k-th turn (``hf_save_direct.turns``), so no two processes write one file at once while there
are enough files. The files must still be every byte what transformers' own ``save_pretrained``
writes, with fewer files than processes, one file only, and more files than processes, on 2 and 4
processes. The model's tensors span many pages at unaligned offsets, so each process's runs have
whole pages (written with ``O_DIRECT``, ``direct_write``) and partial pages shared with a
neighbour's run or the header (through the page cache).
"""

from __future__ import annotations

import os

import pytest
import torch

from trainmesh.checkpoint.direct_write import DirectWriter
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
transformers = pytest.importorskip("transformers")

# bytes per file for the Llama below (about 0.75 MB of tensors): one file, two, more than 4
SHARD_SIZES = ("5GB", 450_000, 90_000)


def build_model():
    """A small Llama whose tensors still cover many 4 KiB pages, with odd sizes (unaligned offsets)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).float()


def test_turns_spread_the_processes_over_the_files():
    from trainmesh.checkpoint.hf_save_direct import turns

    for files in (1, 2, 3, 4, 5, 12):
        for processes in (2, 4):
            orders = [turns(list(range(files)), rank) for rank in range(processes)]
            for order in orders:  # every file once
                assert sorted(order) == list(range(files))
            for k in range(files):  # at each turn, distinct files while there are enough
                at_turn = [order[k] for order in orders]
                assert len(set(at_turn)) == min(files, processes), (files, processes, k, at_turn)
    assert turns([], 3) == []


def _save_zero3(root: str) -> dict:
    import trainmesh as tm
    from trainmesh.checkpoint import direct_write, hf_save_direct

    walked: list[list[str]] = []
    original, direct = hf_save_direct.turns, direct_write.DirectWriter._write_direct
    pages = [0]

    def counting(self, data, at):  # bytes that went around the page cache
        pages[0] += len(data)
        return direct(self, data, at)

    def recording(planned, rank):
        order = original(planned, rank)
        walked.append([plan.filename for plan, _ in order])
        return order

    hf_save_direct.turns = recording
    direct_write.DirectWriter._write_direct = counting
    out: dict = {}
    try:
        model = tm.DataParallel(zero_stage=3).distribute_model(build_model())
        for size in SHARD_SIZES:
            walked.clear()
            path = os.path.join(root, f"zero3-{tm.world_size()}-{size}")
            tm.save_pretrained(model, path, max_shard_size=size)
            out[size] = [list(order) for order in walked]
    finally:
        hf_save_direct.turns, direct_write.DirectWriter._write_direct = original, direct
    out["direct bytes"] = pages[0]
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_files_are_transformers_bytes_whatever_the_turns(tmp_path, world_size):
    results = run_distributed(_save_zero3, world_size=world_size, args=(str(tmp_path),), timeout=240)
    reference_model = build_model()
    counts = []
    for size in SHARD_SIZES:
        reference = tmp_path / f"reference-{size}"
        reference_model.save_pretrained(reference, max_shard_size=size)
        names = sorted(f for f in os.listdir(reference) if f.endswith(".safetensors"))
        counts.append(len(names))
        saved = tmp_path / f"zero3-{world_size}-{size}"
        assert sorted(f for f in os.listdir(saved) if f.endswith(".safetensors")) == names
        for name in names:
            assert (saved / name).read_bytes() == (reference / name).read_bytes(), f"{size}: {name} differs"
        # every process walked every file once, each from its own first file (rank mod F)
        orders = [r[size] for r in results]
        assert all(len(order) == 1 for order in orders)  # one walk of the in-place files per save
        for rank, (order,) in enumerate(orders):
            assert sorted(order) == names and order[0] == names[rank % len(names)], (size, rank, order)
    assert counts[0] == 1 and counts[1] == 2 and counts[2] > 4, counts
    probe = DirectWriter(str(tmp_path / "probe"))
    takes_direct = probe._direct is not None
    probe.close()
    if takes_direct:  # whole pages went around the page cache on every process
        assert all(r["direct bytes"] > 0 for r in results), [r["direct bytes"] for r in results]
