"""Token shards: writer/reader round trip, the completion marker, corruption checks, windows,
the per-epoch order, the split over processes and resumption (simulated ranks, one process)."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch

from trainmesh.data.shard_writer import write_char_shards, write_token_shards
from trainmesh.data.shards import ShardError, TokenShardDataset
from trainmesh.demo.corpus import CharVocab, CharWindows
from trainmesh.distribution.dataset import DistributedBatches

pytestmark = pytest.mark.timeout(120)


def _docs(rng, n_docs=7, vocab=300):
    return [rng.integers(0, vocab, size=int(rng.integers(1, 500))) for _ in range(n_docs)]


@pytest.mark.parametrize("fmt", ["bin", "npy"])
def test_round_trip_tokens_identical(tmp_path, fmt):
    docs = _docs(np.random.default_rng(0))
    index = write_token_shards(docs, tmp_path, vocab_size=300, shard_tokens=257, format=fmt)
    expected = np.concatenate(docs)
    assert index["total_tokens"] == len(expected) == sum(index["shard_tokens"])
    assert all(n == 257 for n in index["shard_tokens"][:-1])
    assert sorted(os.listdir(tmp_path)) == ["index.json"] + [
        f"shard_{i:05d}.{fmt}" for i in range(len(index["shards"]))
    ]
    ds = TokenShardDataset(tmp_path, block_size=8, data_parallel_size=1, data_index=0, verify_checksums=True)
    assert np.array_equal(np.concatenate([np.asarray(a) for a in ds.arrays]), expected)


def test_text_with_tokenizer_and_eot(tmp_path):
    index = write_token_shards(
        ["ab", "c"],
        tmp_path,
        tokenizer=lambda s: [ord(c) - 96 for c in s],
        vocab_size=10,
        eot_id=0,
        tokenizer_description="letters",
    )
    ds = TokenShardDataset(tmp_path, block_size=1, data_parallel_size=1, data_index=0)
    assert np.asarray(ds.arrays[0]).tolist() == [1, 2, 0, 3, 0]
    assert index["tokenizer"] == "letters"
    with pytest.raises(ValueError, match="no tokenizer"):
        write_token_shards(["ab"], tmp_path / "x", vocab_size=10)
    with pytest.raises(ValueError, match="token id 12"):
        write_token_shards([[1, 12]], tmp_path / "y", vocab_size=10)


@pytest.mark.parametrize(
    "vocab_size,dtype", [(256, "uint16"), (65536, "uint16"), (65537, "uint32"), (100_000, "uint32")]
)
def test_dtype_choice(tmp_path, vocab_size, dtype):
    top = vocab_size - 1
    index = write_token_shards([[0, top, 1]], tmp_path, vocab_size=vocab_size)
    assert index["dtype"] == dtype
    assert os.path.getsize(tmp_path / "shard_00000.bin") == 3 * np.dtype(dtype).itemsize
    ds = TokenShardDataset(tmp_path, block_size=2, data_parallel_size=1, data_index=0)
    assert ds[0][0].tolist() == [0, top] and ds[0][0].dtype == torch.int64


def test_directory_without_index_is_rejected(tmp_path):
    write_token_shards([np.arange(100)], tmp_path, vocab_size=128, shard_tokens=30)
    os.remove(tmp_path / "index.json")  # a writer killed before its last step leaves exactly this
    with pytest.raises(ShardError, match="No index.json .*writer did not finish"):
        TokenShardDataset(tmp_path, block_size=4, data_parallel_size=1, data_index=0)


def test_index_is_written_last_and_atomically(tmp_path, monkeypatch):
    import trainmesh.data.shard_writer as writer

    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((sorted(os.listdir(tmp_path)), str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", spy)
    write_token_shards([np.arange(100)], tmp_path, vocab_size=128, shard_tokens=30)
    [(listing, src, dst)] = seen
    assert listing == ["index.json.tmp"] + [f"shard_{i:05d}.bin" for i in range(4)]
    assert src.endswith("index.json.tmp") and dst.endswith("index.json")


def test_existing_directory_needs_overwrite(tmp_path):
    write_token_shards([np.arange(100)], tmp_path, vocab_size=128, shard_tokens=30)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_token_shards([np.arange(10)], tmp_path, vocab_size=128)
    write_token_shards([np.arange(10)], tmp_path, vocab_size=128, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["index.json", "shard_00000.bin"]  # no stale shard left behind


def test_size_and_checksum_mismatch_name_the_shard(tmp_path):
    write_token_shards([np.arange(100)], tmp_path, vocab_size=128, shard_tokens=30)
    shard = tmp_path / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF  # same size, different bytes: only the checksum sees it
    shard.write_bytes(bytes(data))
    TokenShardDataset(tmp_path, block_size=4, data_parallel_size=1, data_index=0)  # size check passes
    with pytest.raises(ShardError, match="shard_00001.bin.*sha256"):
        TokenShardDataset(tmp_path, block_size=4, data_parallel_size=1, data_index=0, verify_checksums=True)
    shard.write_bytes(bytes(data[:-2]))  # truncated
    with pytest.raises(ShardError, match="shard_00001.bin.* 58 bytes.*30 tokens"):
        TokenShardDataset(tmp_path, block_size=4, data_parallel_size=1, data_index=0)
    os.remove(shard)
    with pytest.raises(ShardError, match="shard_00001.bin.*missing"):
        TokenShardDataset(tmp_path, block_size=4, data_parallel_size=1, data_index=0)


def test_npy_dtype_mismatch_names_the_shard(tmp_path):
    write_token_shards([np.arange(100)], tmp_path, vocab_size=128, shard_tokens=30, format="npy")
    np.save(tmp_path / "shard_00002.npy", np.arange(30, dtype=np.int32))
    with pytest.raises(ShardError, match="shard_00002.npy' holds int32"):
        TokenShardDataset(tmp_path, block_size=4, data_parallel_size=1, data_index=0)


def test_windows_shape_and_no_straddling(tmp_path):
    write_token_shards([np.arange(25)], tmp_path, vocab_size=32, shard_tokens=10)  # shards 10, 10, 5
    ds = TokenShardDataset(tmp_path, block_size=4, data_parallel_size=1, data_index=0)
    # per shard: starts 0, 4 (start + 5 <= 10), then 0 for the 5-token shard
    assert len(ds) == 5
    assert [ds.window(i).tolist() for i in range(5)] == [
        [0, 1, 2, 3, 4],
        [4, 5, 6, 7, 8],
        [10, 11, 12, 13, 14],
        [14, 15, 16, 17, 18],
        [20, 21, 22, 23, 24],
    ]
    x, y = ds[1]
    assert x.shape == y.shape == (4,) and x.dtype == y.dtype == torch.int64 and torch.equal(x[1:], y[:-1])
    with pytest.raises(IndexError):
        ds[5]
    shapes = [(xb.shape, yb.shape, xb.dtype) for xb, yb in ds.iter_batches(global_batch_size=2)]
    assert shapes == [((2, 4), (2, 4), torch.int64)] * 2 + [((1, 4), (1, 4), torch.int64)]  # 5 = 2 + 2 + 1


def test_char_shards_match_the_demo_windows(tmp_path):
    text = "def f(x):\n    return x + 1\n" * 40
    vocab = CharVocab.from_text(text)
    index = write_char_shards(text, tmp_path, vocab)
    assert index["tokenizer"].startswith("char:") and CharVocab.from_json(index["tokenizer"][5:]).chars == vocab.chars
    ds = TokenShardDataset(tmp_path, block_size=16, data_parallel_size=1, data_index=0)
    reference = CharWindows(vocab.encode(text), 16)
    assert len(ds) == len(reference)
    for i in range(len(ds)):
        assert all(torch.equal(a, b) for a, b in zip(ds[i], reference[i]))


def test_epoch_order_deterministic_and_different_per_epoch(tmp_path):
    write_token_shards([np.arange(2000) % 97], tmp_path, vocab_size=97, shard_tokens=300)
    a = TokenShardDataset(tmp_path, block_size=8, seed=3, data_parallel_size=1, data_index=0)
    b = TokenShardDataset(tmp_path, block_size=8, seed=3, data_parallel_size=1, data_index=0)
    assert np.array_equal(a.global_order(0), b.global_order(0))
    assert not np.array_equal(a.global_order(0), a.global_order(1))
    assert sorted(a.global_order(1)) == list(range(len(a)))
    c = TokenShardDataset(tmp_path, block_size=8, seed=3, shuffle=False, data_parallel_size=1, data_index=0)
    assert c.global_order(5).tolist() == list(range(len(c)))
    first = [x for x, _ in a.iter_batches(global_batch_size=4)]
    again = [x for x, _ in b.iter_batches(global_batch_size=4)]
    assert all(torch.equal(p, q) for p, q in zip(first, again))
    assert a.state_dict()["epoch"] == 1 and a.state_dict()["cursor"] == 0


def _token_ids(x: torch.Tensor) -> list[int]:
    # Test data where token value == position: the first token identifies its window.
    return x[:, 0].tolist()


def _ranks(path, world, gbs, state=None, **kw):
    ranks = [
        TokenShardDataset(path, block_size=8, seed=1, data_parallel_size=world, data_index=r, **kw)
        for r in range(world)
    ]
    for ds in ranks:
        if state is not None:
            ds.load_state_dict(state)
    return ranks, [ds.iter_batches(gbs) for ds in ranks]


def test_exactly_once_per_epoch_across_ranks(tmp_path):
    write_token_shards([np.arange(8 * 48 + 1)], tmp_path, vocab_size=1 << 12)  # 48 windows
    ranks, iters = _ranks(tmp_path, 4, 8)
    for epoch in range(2):
        seen = []
        for parts in zip(*iters):
            assert [x.shape[0] for x, _ in parts] == [2, 2, 2, 2]
            seen += [t for x, _ in parts for t in _token_ids(x)]
        assert sorted(seen) == [8 * i for i in range(48)]
        iters = [ds.iter_batches() for ds in ranks]  # the next epoch, batch size from the state


@pytest.mark.parametrize("before,after", [(2, 4), (4, 2), (1, 3)])
def test_resume_mid_epoch_on_other_world_size(tmp_path, before, after):
    write_token_shards([np.arange(8 * 60 + 1)], tmp_path, vocab_size=1 << 12, shard_tokens=8 * 60 + 1)
    gbs = 12
    ranks, iters = _ranks(tmp_path, before, gbs)
    seen = []
    for _ in range(2):  # two global batches, then the "crash"
        seen += [t for x, _ in (next(it) for it in iters) for t in _token_ids(x)]
    states = [ds.state_dict() for ds in ranks]
    assert all(s == states[0] for s in states) and states[0]["cursor"] == 2 * gbs
    state = pickle.loads(pickle.dumps(states[0]))
    _, iters = _ranks(tmp_path, after, gbs, state=state)
    for parts in zip(*iters):
        seen += [t for x, _ in parts for t in _token_ids(x)]
    assert sorted(seen) == [8 * i for i in range(60)]


def test_resume_at_epoch_end_starts_next_epoch(tmp_path):
    write_token_shards([np.arange(8 * 8 + 1)], tmp_path, vocab_size=1 << 12)
    ds = TokenShardDataset(tmp_path, block_size=8, data_parallel_size=1, data_index=0)
    ds.load_state_dict({"seed": 0, "epoch": 2, "cursor": 8, "block_size": 8, "global_batch_size": 4})
    batches = list(ds.iter_batches())
    assert len(batches) == 2 and ds.state_dict()["epoch"] == 4  # epoch 3 read in full


def test_remainder_policy(tmp_path):
    write_token_shards([np.arange(8 * 10 + 1)], tmp_path, vocab_size=1 << 12)  # 10 windows
    kept = TokenShardDataset(tmp_path, block_size=8, data_parallel_size=2, data_index=0)
    assert sum(x.shape[0] for x, _ in kept.iter_batches(4)) == 5  # remainder 2 splits over 2: kept
    dropped = TokenShardDataset(tmp_path, block_size=8, data_parallel_size=4, data_index=0)
    with pytest.warns(UserWarning, match="last 2 of 10 windows"):  # 2 over 4 processes: dropped
        assert sum(x.shape[0] for x, _ in dropped.iter_batches(4)) == 2
    strict = TokenShardDataset(tmp_path, block_size=8, data_parallel_size=2, data_index=0, drop_remainder=True)
    assert sum(x.shape[0] for x, _ in strict.iter_batches(4)) == 4  # asked for: no warning


def test_invalid_arguments_name_the_value(tmp_path):
    write_token_shards([np.arange(100)], tmp_path, vocab_size=128)
    with pytest.raises(ValueError, match="block_size=0"):
        TokenShardDataset(tmp_path, block_size=0, data_parallel_size=1, data_index=0)
    with pytest.raises(ValueError, match="data_index=2"):
        TokenShardDataset(tmp_path, block_size=4, data_parallel_size=2, data_index=2)
    ds = TokenShardDataset(tmp_path, block_size=4, data_parallel_size=2, data_index=0)
    with pytest.raises(ValueError, match="global_batch_size=3"):
        ds.iter_batches(3)
    with pytest.raises(ValueError, match="block_size=5"):
        ds.load_state_dict({"seed": 0, "epoch": 0, "cursor": 0, "block_size": 5})
    with pytest.raises(ValueError, match="format='zip'"):
        write_token_shards([[1]], tmp_path / "z", vocab_size=4, format="zip")
    with pytest.raises(ValueError, match="vocab_size=0"):
        write_token_shards([[1]], tmp_path / "z", vocab_size=0)


def test_memory_mapped_not_read(tmp_path):
    n = 24 << 20  # 48 MiB of uint16 shards, written directly (the writer is tested above)
    shard = np.lib.format.open_memmap(tmp_path / "shard_00000.npy", mode="w+", dtype="<u2", shape=(n,))
    shard[::4096] = 7
    shard.flush()
    del shard
    (tmp_path / "index.json").write_text(
        json.dumps(
            {
                "format": "npy",
                "dtype": "uint16",
                "vocab_size": 8,
                "shard_tokens": [n],
                "total_tokens": n,
                "shards": [{"file": "shard_00000.npy", "tokens": n, "sha256": ""}],
                "tokenizer": "test",
            }
        )
    )

    def resident() -> dict[str, int]:  # kB of private (copied) and file-backed (mapped) memory
        with open("/proc/self/status") as fh:
            return {k: int(v.split()[0]) for k, v in (line.split(":") for line in fh) if k in ("RssAnon", "RssFile")}

    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc to measure resident memory")
    before = resident()
    ds = TokenShardDataset(tmp_path, block_size=128, data_parallel_size=1, data_index=0)
    assert all(isinstance(a, np.memmap) for a in ds.arrays)
    batches = ds.iter_batches(8)
    for _ in range(2):
        next(batches)
    after = resident()
    # 16 windows read: nothing like the 48 MiB file may be copied, and only pages near the
    # windows mapped (the kernel maps up to ~64-128 KiB around each touched page).
    assert after["RssAnon"] - before["RssAnon"] < 8 << 10, (before, after)
    assert after["RssFile"] - before["RssFile"] < 12 << 10, (before, after)
    assert len(pickle.dumps(ds)) < 1 << 20  # DataLoader workers reopen the maps instead of copying them


def test_map_style_with_distributed_batches(tmp_path):
    write_token_shards([np.arange(8 * 16 + 1)], tmp_path, vocab_size=1 << 12)
    ds = TokenShardDataset(tmp_path, block_size=8, data_parallel_size=1, data_index=0)
    batches = DistributedBatches(
        ds, global_batch_size=8, data_parallel_size=2, data_index=1, shuffle=True, seed=0, drop_remainder=False
    )
    xs = [x for x, _ in batches]
    assert len(xs) == 2 and xs[0].shape == (4, 8)
