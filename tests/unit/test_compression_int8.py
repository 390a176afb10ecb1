"""int8: wire size, per-chunk error bounds, unbiased stochastic rounding, seeding."""

from __future__ import annotations

import math

import pytest
import torch

from trainmesh.compression import Int8Compressor

pytestmark = pytest.mark.timeout(60)


def _chunk_max(x, chunk):
    flat = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % chunk))
    return flat.view(-1, chunk).abs().amax(dim=1).repeat_interleave(chunk)[: x.numel()].view_as(x)


@pytest.mark.parametrize("numel,chunk", [(1_000_000, 2048), (4099, 2048), (10, 2048), (5000, None)])
def test_wire_size_is_one_byte_per_value_plus_one_fp32_scale_per_chunk(numel, chunk):
    compressed = Int8Compressor(chunk_size=chunk).compress(torch.randn(numel))
    chunks = 1 if chunk is None else math.ceil(numel / chunk)
    assert compressed.tensors["values"].dtype == torch.int8 and compressed.tensors["scale"].dtype == torch.float32
    assert compressed.nbytes() == numel + 4 * chunks
    if numel == 1_000_000:
        assert numel * 4 / compressed.nbytes() >= 3.9


def test_nearest_error_is_at_most_half_a_step_of_its_own_chunk():
    x = torch.randn(10_000) * torch.linspace(0.01, 100, 10_000)  # chunks of very different scale
    x[77] = 1e4  # an outlier only coarsens its own chunk
    compressor = Int8Compressor(chunk_size=256)
    dense = compressor.decompress(compressor.compress(x))
    step = _chunk_max(x, 256) / 127
    assert bool(((dense - x).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all())
    # Relative error of the whole tensor, for the record: well under 1%.
    assert float((dense - x).norm() / x.norm()) < 0.01
    # The outlier's coarse step (1e4/127) stayed in chunk 0; one scale per tensor would
    # round the whole next chunk (|x| < 20) to zero.
    per_tensor = Int8Compressor(chunk_size=None)
    coarse = per_tensor.decompress(per_tensor.compress(x))
    assert float((dense[256:512] - x[256:512]).abs().max()) < 0.1
    assert float((coarse[256:512] - x[256:512]).abs().max()) > 1.0


def test_stochastic_error_is_under_one_step_and_unbiased():
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    step = float(x.abs().max()) / 127
    stochastic = Int8Compressor(chunk_size=64, rounding="stochastic", seed=11)
    samples = torch.stack([stochastic.decompress(stochastic.compress(x)) for _ in range(4000)])
    assert bool(((samples - x).abs() < step * (1 + 1e-5)).all())
    # Mean of 4000 draws: the rounding noise (std <= step/2) averages to <= step/(2*sqrt(4000))
    # per element; 0.05 * step is over 6 of those standard errors.
    mean_error = (samples.mean(dim=0) - x).abs().max()
    assert float(mean_error) < 0.05 * step
    # Nearest rounding is biased for a fixed x: the same test would fail for it.
    nearest = Int8Compressor(chunk_size=64)
    assert float((nearest.decompress(nearest.compress(x)) - x).abs().max()) > 0.2 * step


def test_stochastic_rounding_repeats_with_the_seed():
    x = torch.randn(1000)
    a, b, c = (Int8Compressor(rounding="stochastic", seed=s) for s in (5, 5, 6))
    va, vb, vc = (comp.compress(x).tensors["values"] for comp in (a, b, c))
    assert torch.equal(va, vb) and not torch.equal(va, vc)


def test_zeros_and_empty_tensors():
    compressor = Int8Compressor(chunk_size=8, rounding="stochastic")
    zeros = torch.zeros(3, 5)
    assert torch.equal(compressor.decompress(compressor.compress(zeros)), zeros)
    empty = torch.zeros(0)
    assert compressor.decompress(compressor.compress(empty)).shape == (0,)


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="chunk_size"):
        Int8Compressor(chunk_size=0)
    with pytest.raises(ValueError, match="rounding"):
        Int8Compressor(rounding="up")
    compressed = Int8Compressor().compress(torch.randn(10))
    compressed.meta["numel"] = 11
    with pytest.raises(ValueError, match="numel"):
        Int8Compressor().decompress(compressed)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("numel", [8192, 8191])  # whole chunks (a view, no copy) and a short last chunk
def test_payload_is_the_textbook_formula_bit_for_bit(rounding, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(2)) * 5
    x[:2048] = 0.0  # an all-zero chunk: scale +0, values 0
    x[3000] = -40.0  # a chunk whose largest magnitude is negative
    compressed = Int8Compressor(rounding=rounding, seed=3).compress(x)
    # the reference: pad, |x| max per chunk, scale, round (or floor(x/s + u)), clamp
    padded = torch.nn.functional.pad(x, (0, -numel % 2048)).view(-1, 2048)
    scale = padded.abs().amax(dim=1) / 127
    scaled = padded * torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))[:, None]
    if rounding == "nearest":
        rounded = torch.round(scaled)
    else:
        rounded = torch.floor(scaled + torch.rand(scaled.shape, generator=torch.Generator().manual_seed(3)))
    values = rounded.clamp(-127, 127).to(torch.int8).reshape(-1)[:numel]
    assert torch.equal(compressed.tensors["values"], values)
    assert torch.equal(compressed.tensors["scale"].view(torch.int32), scale.view(torch.int32))  # bits: +0 is not -0
    dense = Int8Compressor().decompress(compressed)
    expected = (torch.nn.functional.pad(values.float(), (0, -numel % 2048)).view(-1, 2048) * scale[:, None]).reshape(
        -1
    )[:numel]
    assert torch.equal(dense.view(torch.int32), expected.view(torch.int32))
