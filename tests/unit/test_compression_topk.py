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
    assert compressed.meta["k"] == k == compressed.tensors["indices"].numel()
    assert compressed.tensors["indices"].dtype == torch.int32 and compressed.tensors["values"].dtype == torch.float32
    assert compressed.nbytes() == k * 8
    expected = set(torch.argsort(x.reshape(-1).abs(), descending=True)[:k].tolist())
    assert set(compressed.tensors["indices"].tolist()) == expected
    dense = compressor.decompress(compressed)
    kept = dense != 0
    assert int(kept.sum()) == k and torch.equal(dense[kept], x[kept])


def test_fp16_values_option_and_half_gradients():
    x = torch.randn(1000, dtype=torch.float16)
    compressed = TopKCompressor(0.1, values="fp16").compress(torch.randn(1000))
    assert compressed.tensors["values"].dtype == torch.float16 and compressed.nbytes() == 100 * 6
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
    for kwargs, word in [({"ratio": 0}, "ratio"), ({"ratio": 1.5}, "ratio"), ({"momentum": 1.0}, "momentum"),
                         ({"momentum": 0.9, "error_feedback": False}, "error_feedback"),
                         ({"warmup_steps": -1}, "warmup_steps"), ({"values": "int8"}, "values")]:
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
