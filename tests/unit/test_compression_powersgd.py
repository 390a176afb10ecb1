"""PowerSGD: factor shapes and bytes, exactness on low-rank matrices, warm start, pass-through,
and the mapping to torch's DDP PowerSGD hook state."""

from __future__ import annotations

import pytest
import torch

from trainmesh.compression import PowerSGDCompressor

pytestmark = pytest.mark.timeout(60)


def test_sends_p_and_q_factors():
    compressor = PowerSGDCompressor(2)
    compressed = compressor.compress(torch.randn(100, 60), "w")
    assert compressed.tensors["p"].shape == (100, 2) and compressed.tensors["q"].shape == (60, 2)
    assert compressed.nbytes() == (100 + 60) * 2 * 4 and compressed.meta["passthrough"] is False
    assert set(compressor.state_dict()) == {"residuals", "q_memory"}
    assert compressor.state_dict()["q_memory"]["w"].shape == (60, 2)


def test_a_low_rank_matrix_is_reproduced_exactly_in_one_step():
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(80, 2, generator=generator) @ torch.randn(2, 50, generator=generator)
    compressor = PowerSGDCompressor(2, error_feedback=False)
    dense = compressor.decompress(compressor.compress(matrix))
    assert float((dense - matrix).norm() / matrix.norm()) < 1e-5


def test_warm_start_converges_to_the_best_rank_r_approximation():
    generator = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(60, 60, generator=generator))
    w, _ = torch.linalg.qr(torch.randn(40, 40, generator=generator))
    singular = torch.tensor([10.0, 6.0, 3.0] + [0.5] * 37)
    matrix = u[:, :40] @ torch.diag(singular) @ w.T
    best = float(singular[2:].norm())  # Eckart-Young: error of the best rank-2 approximation
    warm = PowerSGDCompressor(2, error_feedback=False)
    cold = PowerSGDCompressor(2, error_feedback=False, warm_start=False)
    for _ in range(15):
        warm_error = float((warm.decompress(warm.compress(matrix, "m")) - matrix).norm())
        cold_error = float((cold.decompress(cold.compress(matrix, "m")) - matrix).norm())
    assert warm_error < best * 1.01
    assert cold_error > warm_error  # one power iteration from a random Q each time is worse


@pytest.mark.parametrize("shape", [(1000,), (3, 3), ()])
def test_vectors_and_tiny_matrices_pass_through(shape):
    compressor = PowerSGDCompressor(2)
    x = torch.randn(shape)
    compressed = compressor.compress(x, "b")
    assert compressed.meta["passthrough"] is True and compressed.nbytes() == x.numel() * 4
    assert torch.equal(compressor.decompress(compressed), x)
    assert float(compressor.residuals["b"].abs().max()) == 0.0 if x.numel() else True


def test_conv_weights_are_compressed_as_out_channels_by_the_rest():
    compressor = PowerSGDCompressor(1)
    compressed = compressor.compress(torch.randn(16, 8, 3, 3), "conv")
    assert compressed.tensors["p"].shape == (16, 1) and compressed.tensors["q"].shape == (72, 1)
    assert compressor.decompress(compressed).shape == (16, 8, 3, 3)


def test_torch_state_maps_the_configuration():
    compressor = PowerSGDCompressor(3, error_feedback=False, warm_start=True, min_compression_rate=4, seed=7)
    state = compressor.torch_state(None, start_iter=5)
    assert state.matrix_approximation_rank == 3 and state.start_powerSGD_iter == 5
    assert state.use_error_feedback is False and state.warm_start is True
    assert state.min_compression_rate == 4


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="rank"):
        PowerSGDCompressor(0)
    with pytest.raises(ValueError, match="min_compression_rate"):
        PowerSGDCompressor(1, min_compression_rate=0.5)
