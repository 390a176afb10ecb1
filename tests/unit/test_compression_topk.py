"""top-k: exactly the k largest entries, wire format, warm-up and DGC momentum correction."""

from __future__ import annotations

import math

import pytest
import torch

from trainmesh.compression import TopKCompressor

pytestmark = pytest.mark.timeout(60)


def test_keeps_exactly_the_k_largest_magnitudes():
    generator = torch.Generator().manual_seed(0)
    # Distinct magnitudes with random signs, shuffled: "the k largest" is unambiguous.
    magnitudes = torch.randperm(10_000, generator=generator).double() + 1
    x = (magnitudes * torch.where(torch.rand(10_000, generator=generator) < 0.5, -1.0, 1.0)).float().view(100, 100)
    compressor = TopKCompressor(0.013, error_feedback=False)
    compressed = compressor.compress(x)
    k = math.ceil(0.013 * 10_000)
    # One block (10,000 <= 65536 entries): 16-bit offsets (two bytes each) and no counts.
    assert sorted(compressed.tensors) == ["offsets", "values"]
    assert compressed.meta["k"] == k == compressed.tensors["offsets"].shape[0] == compressed.tensors["values"].numel()
    assert compressed.tensors["offsets"].dtype == torch.uint8 and compressed.tensors["values"].dtype == torch.float32
    assert compressed.nbytes() == k * 6
    expected = torch.argsort(x.reshape(-1).abs(), descending=True)[:k].sort().values
    offsets = compressed.tensors["offsets"].long()
    assert torch.equal(offsets[:, 0] + 256 * offsets[:, 1], expected)  # sorted by index, low byte first
    dense = compressor.decompress(compressed)
    kept = dense != 0
    assert int(kept.sum()) == k and torch.equal(dense[kept], x[kept])


def test_fp16_values_option_and_half_gradients():
    x = torch.randn(1000, dtype=torch.float16)
    compressed = TopKCompressor(0.1, values="fp16").compress(torch.randn(1000))
    assert compressed.tensors["values"].dtype == torch.float16 and compressed.nbytes() == 100 * 4
    half = TopKCompressor(0.1).compress(x)
    assert half.tensors["values"].dtype == torch.float16
    assert TopKCompressor(0.1).decompress(half).dtype == torch.float16


def test_warmup_falls_exponentially_from_a_quarter_to_the_ratio():
    compressor = TopKCompressor(0.001, warmup_steps=4)
    ks, ratios = [], []
    for _ in range(6):
        ratios.append(compressor.current_ratio("w"))
        ks.append(compressor.compress(torch.randn(10_000), "w").meta["k"])
    expected = [0.25 * (0.001 / 0.25) ** (t / 4) for t in range(4)] + [0.001, 0.001]
    assert ratios == pytest.approx(expected)
    assert ks == [math.ceil(r * 10_000) for r in expected]
    assert compressor.current_ratio("never_seen") == 0.25  # warm-up counts per key
    assert TopKCompressor(0.5, warmup_steps=4).current_ratio() == 0.5  # above 25%: no warm-up


def test_dgc_momentum_correction_matches_the_paper_recurrence():
    momentum, ratio, steps = 0.9, 0.1, 12
    compressor = TopKCompressor(ratio, momentum=momentum)
    u = torch.zeros(50, dtype=torch.float64)
    v = torch.zeros(50, dtype=torch.float64)
    true_velocity_sum = torch.zeros(50, dtype=torch.float64)
    sent_sum = torch.zeros(50, dtype=torch.float64)
    for step in range(steps):
        g = torch.randn(50, generator=torch.Generator().manual_seed(step))
        # Lin et al. 2018, Algorithm 1 with momentum correction and factor masking.
        u = momentum * u + g.double()
        v = v + u
        true_velocity_sum += u
        k = math.ceil(ratio * 50)
        top = torch.topk(v.abs(), k).indices
        sent = torch.zeros_like(v)
        sent[top] = v[top]
        u[top] = 0
        v[top] = 0
        got = compressor.decompress(compressor.compress(g, "w")).double()
        torch.testing.assert_close(got, sent, rtol=0, atol=1e-5)
        sent_sum += got
        assert bool((compressor.momentum_buffers["w"].reshape(-1)[got != 0] == 0).all())
    torch.testing.assert_close(compressor.residuals["w"].double(), v, rtol=0, atol=1e-5)
    # Nothing is lost: what was sent plus what is held equals the sum of the momentum velocities.
    torch.testing.assert_close(sent_sum + compressor.residuals["w"].double(), true_velocity_sum, rtol=0, atol=1e-4)


def test_bad_options_are_rejected():
    for kwargs, word in [
        ({"ratio": 0}, "ratio"),
        ({"ratio": 1.5}, "ratio"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": 0.9, "error_feedback": False}, "error_feedback"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"values": "int8"}, "values"),
    ]:
        with pytest.raises(ValueError, match=word):
            TopKCompressor(**kwargs)


@pytest.mark.parametrize("numel,ratio", [(200_000, 0.01), (1_000_003, 0.001), (300_000, 0.05), (70_000, 0.2)])
def test_sampled_selection_finds_the_same_set_as_torch_topk(numel, ratio):
    from trainmesh.compression.topk import largest_magnitudes

    generator = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) ** 4  # heavy tails
    k = math.ceil(ratio * numel)
    got = largest_magnitudes(x, k, torch.Generator().manual_seed(1))
    assert got.numel() == k and got.unique().numel() == k
    assert set(got.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_sampled_selection_falls_back_when_the_sample_misjudges(monkeypatch):
    from trainmesh.compression import topk

    x = torch.randn(400_000, generator=torch.Generator().manual_seed(5))
    k = 4000
    sizes = []
    real_topk = torch.topk

    def recording_topk(values, *args, **kwargs):
        sizes.append(values.numel())
        return real_topk(values, *args, **kwargs)

    monkeypatch.setattr(topk.torch, "topk", recording_topk)
    monkeypatch.setattr(topk, "CANDIDATE_MARGIN", 0.5)  # a threshold that keeps about k / 2 candidates
    got = topk.largest_magnitudes(x, k, torch.Generator().manual_seed(0))
    assert sizes == [400_000]  # the whole tensor, once: the fallback
    assert set(got.tolist()) == set(real_topk(x.abs(), k).indices.tolist())
    monkeypatch.setattr(topk, "CANDIDATE_MARGIN", 1.25)
    sizes.clear()
    x[7] = float("nan")  # torch.topk ranks a NaN largest; the candidates keep it
    assert 7 in set(topk.largest_magnitudes(x, k, torch.Generator().manual_seed(0)).tolist())
    assert sizes and sizes[0] < 400_000  # (the sampled path, not the fallback)


@pytest.mark.parametrize("values", ["same", "fp16"])
def test_error_feedback_residual_is_what_was_not_sent(values):
    generator = torch.Generator().manual_seed(3)
    compressor = TopKCompressor(0.01, values=values)
    total_in = torch.zeros(300, 1000)
    total_sent = torch.zeros(300, 1000)
    for _ in range(5):
        g = torch.randn(300, 1000, generator=generator)
        before = compressor.residuals.get("w", torch.zeros_like(g)).clone()
        sent = compressor.compress(g, key="w")
        dense = compressor.decompress(sent)
        assert torch.equal(compressor.residuals["w"], (g + before) - dense)  # the formula, bit for bit
        accumulated = torch.zeros(300_000)
        compressor.add_to(accumulated, sent)  # what an all-gather adds: the same as the dense form
        assert torch.equal(accumulated.view(300, 1000), dense)
        total_in += g
        total_sent += dense
    assert torch.allclose(total_sent + compressor.residuals["w"], total_in, atol=1e-5)


# --- wire format: block offsets ----------------------------------------------------------------
BLOCK = 65536
# Kept entries of a 3 * BLOCK + 17 tensor: 6 in the first block, 3 in the short last one, none
# between (9 entries: 18 bytes of offsets and 16 of counts, fewer than 36 of int32 indices).
FIRST_AND_LAST = [0, 1, 3, 255, 256, BLOCK - 1, 3 * BLOCK, 3 * BLOCK + 1, 3 * BLOCK + 16]


def _planted(numel: int, positions: list[int], seed: int = 0) -> torch.Tensor:
    """Small noise, and entries of magnitude >= 100 at ``positions``: the top-len(positions)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(numel, generator=generator) * 2 - 1
    signs = torch.where(torch.rand(len(positions), generator=generator) < 0.5, -1.0, 1.0)
    x[torch.tensor(positions)] = (100.0 + torch.arange(len(positions), dtype=torch.float32)) * signs
    return x


def _ratio_for(k: int, numel: int) -> float:
    return (k - 0.5) / numel  # ceil(ratio * numel) == k, whatever the rounding of the division


@pytest.mark.parametrize(
    "numel, positions, counts",
    [
        (1000, [0, 7, 999], None),  # below one block
        (BLOCK, [0, 255, 256, BLOCK - 1], None),  # exactly one block
        (3 * BLOCK + 17, FIRST_AND_LAST, [6, 0, 0, 3]),  # empty blocks between
    ],
)
@pytest.mark.parametrize("values", ["same", "fp16"])
def test_block_offsets_round_trip_exactly(numel, positions, counts, values):
    x = _planted(numel, positions)
    compressor = TopKCompressor(_ratio_for(len(positions), numel), values=values)
    compressed = compressor.compress(x, "w")
    k = len(positions)
    assert compressed.meta["k"] == k
    assert compressed.tensors["offsets"].dtype == torch.uint8 and compressed.tensors["offsets"].shape == (k, 2)
    if counts is None:
        assert "counts" not in compressed.tensors  # one block: its count is k
    else:
        assert compressed.tensors["counts"].dtype == torch.int32
        assert compressed.tensors["counts"].tolist() == counts
    indices, sent = TopKCompressor._sent(compressed)
    assert indices.dtype == torch.int64 and indices.tolist() == positions  # sorted by index
    value_dtype = torch.float16 if values == "fp16" else torch.float32
    assert torch.equal(sent, x[positions].to(value_dtype))  # the values follow the indices' order
    expected = torch.zeros(numel)
    expected[positions] = x[positions].to(value_dtype).float()
    assert torch.equal(compressor.decompress(compressed), expected)
    total = torch.ones(numel)
    compressor.add_to(total, compressed)
    assert torch.equal(total, torch.ones(numel) + expected)
    assert torch.equal(compressor.residuals["w"], x - expected)  # error feedback: exactly what was not sent


def test_payload_layout_depends_on_the_size_only():
    # An all-gather unpacks every rank's payload with its own layout.
    compressor = TopKCompressor(0.01, error_feedback=False)
    layouts = {
        tuple((name, t.dtype, tuple(t.shape)) for name, t in compressor.compress(x).tensors.items())
        for x in (torch.randn(3 * BLOCK + 17), torch.zeros(3 * BLOCK + 17), _planted(3 * BLOCK + 17, [0]))
    }
    assert len(layouts) == 1


@pytest.mark.parametrize("values, at_most", [("same", 6.1), ("fp16", 4.1)])
def test_one_percent_of_a_million_entries_costs_about_six_bytes_per_kept_entry(values, at_most):
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    compressed = TopKCompressor(0.01, values=values).compress(x)
    k = compressed.meta["k"]
    assert k == math.ceil(0.01 * (1 << 20))
    nbytes = sum(t.nbytes for t in compressed.tensors.values())
    assert nbytes == compressed.nbytes() and nbytes / k <= at_most
    assert x.nbytes / nbytes >= 66.0 if values == "same" else x.nbytes / nbytes >= 99.0


def test_flat_indices_where_counts_would_cost_more_than_offsets_save():
    from trainmesh.compression.topk import sends_offsets

    # 1 entry of 3 blocks: 2 bytes of offset + 12 of counts > a 4-byte index.
    numel = 3 * BLOCK + 17
    x = _planted(numel, [2 * BLOCK + 5])
    compressor = TopKCompressor(_ratio_for(1, numel), error_feedback=False)
    compressed = compressor.compress(x)
    assert sorted(compressed.tensors) == ["indices", "values"] and compressed.tensors["indices"].dtype == torch.int32
    assert compressed.tensors["indices"].tolist() == [2 * BLOCK + 5] and compressed.nbytes() == 8
    assert torch.equal(compressor.decompress(compressed)[2 * BLOCK + 5], x[2 * BLOCK + 5])
    # Never larger than int32 indices, whatever the size and k.
    for n in (1, 1000, BLOCK, BLOCK + 1, 10 * BLOCK, 10**7):
        for k in sorted({1, 2, 5, 19, 20, 21, 1000, n // 100, n} - {0}):
            k = min(k, n)
            offsets = 2 * k + (4 * -(-n // BLOCK) if n > BLOCK else 0)
            assert sends_offsets(n, k) == (offsets <= 4 * k), (n, k)


def _valid_payload(numel: int = 3 * BLOCK + 17, positions: list[int] = FIRST_AND_LAST):
    from trainmesh.compression import Compressed

    compressor = TopKCompressor(_ratio_for(len(positions), numel), error_feedback=False)
    compressed = compressor.compress(_planted(numel, positions))
    assert "offsets" in compressed.tensors

    def changed(**tensors):
        fresh = {name: t.clone() for name, t in compressed.tensors.items()}
        fresh.update(tensors)
        return Compressed({name: t for name, t in fresh.items() if t is not None}, compressed.meta)

    return compressor, compressed, changed


@pytest.mark.parametrize(
    "case, match",
    [
        ("counts add up to more", "add up to"),
        ("counts add up to less", "add up to"),
        ("a negative count", "negative"),
        ("an offset past the last block's end", "past"),
        ("an entry moved into the short last block", "past"),
        ("no counts", "no 'counts'"),
        ("counts of the wrong length", "'counts' must be"),
        ("int64 counts", "'counts' must be"),
        ("an offset missing", "'offsets' must be"),
        ("int16 offsets", "'offsets' must be"),
        ("no offsets", "neither"),
    ],
)
def test_a_malformed_block_payload_is_rejected_with_a_value_error(case, match):
    compressor, good, changed = _valid_payload()
    counts, offsets = good.tensors["counts"], good.tensors["offsets"]
    bad = {
        "counts add up to more": lambda: changed(counts=counts + torch.tensor([0, 0, 0, 1], dtype=torch.int32)),
        "counts add up to less": lambda: changed(counts=counts - torch.tensor([1, 0, 0, 0], dtype=torch.int32)),
        "a negative count": lambda: changed(counts=torch.tensor([7, -1, 0, 3], dtype=torch.int32)),
        "an offset past the last block's end": lambda: changed(
            offsets=torch.cat([offsets[:-1], torch.tensor([[17, 0]], dtype=torch.uint8)])
        ),
        # Counts still add up to k, but the sixth entry (offset 65535) now lies in the 17-entry block.
        "an entry moved into the short last block": lambda: changed(
            counts=torch.tensor([5, 0, 0, 4], dtype=torch.int32)
        ),
        "no counts": lambda: changed(counts=None),
        "counts of the wrong length": lambda: changed(counts=counts[:3]),
        "int64 counts": lambda: changed(counts=counts.long()),
        "an offset missing": lambda: changed(offsets=offsets[:-1]),
        "int16 offsets": lambda: changed(offsets=offsets.to(torch.int16)),
        "no offsets": lambda: changed(offsets=None, counts=None),
    }[case]()
    compressor.decompress(good)  # (the unchanged payload decodes)
    with pytest.raises(ValueError, match=match):
        compressor.decompress(bad)
    with pytest.raises(ValueError, match=match):
        compressor.add_to(torch.zeros(good.meta["numel"]), bad)


def test_a_malformed_single_block_or_flat_payload_is_rejected_with_a_value_error():
    from trainmesh.compression import Compressed

    compressor, good, changed = _valid_payload(1000, [5, 999])
    compressor.decompress(good)
    with pytest.raises(ValueError, match="past its 1000 entries"):
        compressor.decompress(changed(offsets=torch.tensor([[0, 0], [232, 3]], dtype=torch.uint8)))  # 1000
    with pytest.raises(ValueError, match="'offsets' must be"):
        compressor.decompress(changed(values=torch.ones(3)))
    # Flat indices (what a tensor with too few kept entries per block sends, and the old format).
    meta = {"shape": [1000], "dtype": "float32", "numel": 1000, "k": 2}
    ok = Compressed({"indices": torch.tensor([998, 3], dtype=torch.int32), "values": torch.tensor([1.0, 2.0])}, meta)
    assert compressor.decompress(ok)[[3, 998]].tolist() == [2.0, 1.0]
    for indices, match in [([1000, 3], "outside"), ([-1, 3], "outside"), ([1, 2, 3], "'indices' must be")]:
        with pytest.raises(ValueError, match=match):
            compressor.decompress(
                Compressed(
                    {"indices": torch.tensor(indices, dtype=torch.int32), "values": torch.tensor([1.0, 2.0])}, meta
                )
            )


def test_a_payload_whose_count_or_size_disagrees_with_its_meta_is_rejected():
    from trainmesh.compression import Compressed

    compressor, good, _ = _valid_payload(1000, [5, 999])
    # values and offsets agree with each other (three entries), the meta says two were kept
    three = Compressed(
        {"offsets": torch.tensor([[5, 0], [6, 0], [231, 3]], dtype=torch.uint8), "values": torch.ones(3)}, good.meta
    )
    assert good.meta["k"] == 2
    with pytest.raises(ValueError, match="says it keeps 2 entries but carries 3"):
        compressor.decompress(three)
    with pytest.raises(ValueError, match="cannot be added to a tensor of 999"):
        compressor.add_to(torch.zeros(999), good)
    total = torch.zeros(1000)
    compressor.add_to(total, good)  # the right size: the two entries land
    assert total.count_nonzero().item() == 2
