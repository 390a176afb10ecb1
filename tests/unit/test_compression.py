"""Properties shared by every compressor: round trip shape/dtype, the error-feedback invariant,
state that survives torch.save and a world-size change, the registry and bad input.
(Per-compressor bounds live in test_compression_<name>.py.)"""

from __future__ import annotations

import pytest
import torch

from trainmesh.compression import (
    BF16Compressor,
    Compressed,
    Compressor,
    FP16Compressor,
    Int8Compressor,
    PowerSGDCompressor,
    TopKCompressor,
    get_compressor,
)

pytestmark = pytest.mark.timeout(60)


# Factories, so that every test starts from a fresh (stateless) compressor.
FACTORIES = {
    "fp16": lambda: FP16Compressor(error_feedback=True),
    "bf16": lambda: BF16Compressor(error_feedback=True),
    "int8": lambda: Int8Compressor(error_feedback=True, chunk_size=64),
    "int8-stochastic": lambda: Int8Compressor(error_feedback=True, rounding="stochastic", chunk_size=64),
    "topk": lambda: TopKCompressor(0.05),
    "topk-dgc": lambda: TopKCompressor(0.05, momentum=0.5),
    "powersgd": lambda: PowerSGDCompressor(2),
}


def gradient(step, shape=(40, 30), dtype=torch.float32):
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(shape, generator=generator) * (1 + step % 3)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", FACTORIES)
def test_round_trip_keeps_shape_dtype_and_leaves_the_input_alone(name, dtype):
    compressor = FACTORIES[name]()
    tensor = gradient(0, dtype=dtype)
    original = tensor.clone()
    compressed = compressor.compress(tensor, key="w")
    dense = compressor.decompress(compressed)
    assert dense.shape == tensor.shape and dense.dtype == dtype
    assert torch.equal(tensor, original)
    assert compressed.nbytes() == sum(t.numel() * t.element_size() for t in compressed.tensors.values())
    assert compressed.nbytes() <= tensor.numel() * tensor.element_size()
    assert compressed.meta["shape"] == [40, 30] and compressed.meta["dtype"] == str(dtype).removeprefix("torch.")
    # The decompressed tensor is an approximation, not garbage: it points the same way.
    cosine = torch.nn.functional.cosine_similarity(dense.double().reshape(-1), tensor.double().reshape(-1), dim=0)
    assert cosine > 0.2


@pytest.mark.parametrize("name", [n for n in FACTORIES if n != "topk-dgc"])  # DGC: see test_compression_topk
def test_error_feedback_sent_plus_residual_equals_sum_of_true_tensors(name):
    compressor = FACTORIES[name]()
    true_sum = torch.zeros(40, 30, dtype=torch.float64)
    sent_sum = torch.zeros(40, 30, dtype=torch.float64)
    # The only error is fp32 rounding of the two element-wise operations of each step, ``corrected =
    # g + residual`` and ``residual = corrected - sent``: at most 2**-24 of each result (round to
    # nearest). Element-wise, so no CPU's summation order enters (PowerSGD's matmul does, but the
    # residual subtracts the very tensor that is sent). The bound adds them up as the steps go.
    bound = torch.zeros(40, 30, dtype=torch.float64)
    residual = torch.zeros(40, 30, dtype=torch.float64)
    for step in range(60):
        g = gradient(step)
        true_sum += g.double()
        sent_sum += compressor.decompress(compressor.compress(g, key="w")).double()
        if step == 0 and not isinstance(compressor, (FP16Compressor, BF16Compressor)):
            assert float((true_sum - sent_sum).abs().max()) > 1e-3  # something was held back
        corrected = g.double() + residual
        residual = compressor.residuals["w"].double()
        bound += 2**-24 * (1 + 2**-22) * (corrected.abs() + residual.abs())  # (1 + 2**-22): |fp32| vs exact
    error = (sent_sum + residual - true_sum).abs()
    assert bool((error <= bound).all()), float((error - bound).max())
    assert float(bound.max()) < 1e-4  # no looser than the fixed 1e-4 this test used before


def test_without_error_feedback_nothing_is_kept():
    compressor = TopKCompressor(0.05, error_feedback=False)
    a = compressor.compress(gradient(0), "w")
    b = compressor.compress(gradient(0), "w")
    assert compressor.residuals == {} and a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[name], b.tensors[name]) for name in a.tensors)  # the same entries again


def _assert_plain(value, path="state"):
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), path
            _assert_plain(v, f"{path}[{k!r}]")
    elif isinstance(value, torch.Tensor):
        assert value.device.type == "cpu", path
    else:
        assert isinstance(value, (int, float)), (path, type(value))


def _momentum_topk():
    return TopKCompressor(0.05, momentum=0.9, warmup_steps=5)


STATEFUL = [
    lambda: Int8Compressor(rounding="stochastic", error_feedback=True),
    _momentum_topk,
    lambda: PowerSGDCompressor(2),
    lambda: BF16Compressor(error_feedback=True),
]


@pytest.mark.parametrize("make", STATEFUL)
def test_state_dict_survives_torch_save_and_continues_exactly(make, tmp_path):
    first = make()
    for step in range(3):
        for key in ("a", "b"):
            first.compress(gradient(step + (key == "b")), key)
    state = first.state_dict()
    _assert_plain(state)
    torch.save(state, tmp_path / "compressor.pt")
    second = make()
    second.load_state_dict(torch.load(tmp_path / "compressor.pt", weights_only=True))
    for key in ("a", "b"):
        x, y = first.compress(gradient(7), key), second.compress(gradient(7), key)
        for name in x.tensors:
            assert torch.equal(x.tensors[name], y.tensors[name]), (key, name)
        assert x.meta == y.meta
        assert torch.equal(first.residuals[key], second.residuals[key])


def test_resize_residuals_preserves_mean_residual_mass():
    old = [TopKCompressor(0.1, momentum=0.5) for _ in range(3)]
    for rank, compressor in enumerate(old):
        for step in range(rank + 1):  # ranks saw different numbers of steps
            compressor.compress(gradient(10 * rank + step), "w")
        if rank == 1:
            compressor.compress(gradient(99, shape=(5,)), "only_on_rank1")
    states = [c.state_dict() for c in old]
    for new_world in (1, 2, 5):
        new_states = TopKCompressor.resize_residuals(states, new_world)
        assert len(new_states) == new_world
        for field in ("residuals", "momentum"):
            for key in ("w", "only_on_rank1"):
                before = sum(s[field].get(key, 0) for s in states) / 3
                after = sum(s[field][key] for s in new_states) / new_world
                torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
        assert all(s["steps"] == {"w": 3, "only_on_rank1": 1} for s in new_states)
        fresh = TopKCompressor(0.1, momentum=0.5)
        fresh.load_state_dict(new_states[-1])
        fresh.compress(gradient(5), "w")  # a resized state is usable


def test_resize_residuals_rejects_bad_input():
    with pytest.raises(ValueError, match="new_world_size"):
        Int8Compressor.resize_residuals([{"residuals": {}}], 0)
    with pytest.raises(ValueError, match="non-empty list"):
        Int8Compressor.resize_residuals([], 2)


@pytest.mark.parametrize("name", FACTORIES)
def test_bad_input_gets_a_clear_error(name):
    compressor = FACTORIES[name]()
    with pytest.raises(TypeError, match="torch.Tensor"):
        compressor.compress([1.0, 2.0])
    with pytest.raises(ValueError, match="floating-point"):
        compressor.compress(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="key"):
        compressor.compress(torch.ones(4, 4), key=3)
    compressor.compress(torch.ones(40, 30), key="w")
    with pytest.raises(ValueError, match="shape"):
        compressor.compress(torch.ones(30, 40), key="w")
    with pytest.raises(TypeError, match="dict"):
        compressor.load_state_dict([1])


def test_registry_builds_every_spec():
    assert get_compressor(None) is None and get_compressor("none") is None and get_compressor(" None ") is None
    assert isinstance(get_compressor("fp16"), FP16Compressor) and get_compressor("fp16").summable
    assert isinstance(get_compressor("bf16"), BF16Compressor) and get_compressor("bf16").summable
    assert get_compressor("int8").rounding == "nearest"
    assert get_compressor("int8:stochastic").rounding == "stochastic"
    half = get_compressor("topk:0.01:fp16")
    assert isinstance(half, TopKCompressor) and half.ratio == 0.01
    sent = half.compress(torch.randn(10_000), key="w")
    assert sent.tensors["values"].dtype == torch.float16 and 10_000 * 4 / sent.nbytes() > 60
    topk = get_compressor("topk:0.01")
    assert isinstance(topk, TopKCompressor) and topk.ratio == 0.01 and topk.error_feedback
    powersgd = get_compressor("powersgd:2")
    assert isinstance(powersgd, PowerSGDCompressor) and powersgd.rank == 2
    instance = TopKCompressor(0.5)
    assert get_compressor(instance) is instance
    assert not any(c.summable for c in (topk, powersgd, get_compressor("int8")))


@pytest.mark.parametrize(
    "spec", ["gzip", "topk:", "topk:abc", "topk:0", "topk:1.5", "powersgd:0", "powersgd:1.5", "int8:banker", "fp16:2"]
)
def test_registry_rejects_unknown_or_malformed_specs(spec):
    with pytest.raises(ValueError, match="Received") as info:
        get_compressor(spec)
    if spec == "gzip":
        assert "topk:<ratio>" in str(info.value) and "powersgd:<rank>" in str(info.value)


def test_registry_rejects_non_string_specs():
    with pytest.raises(TypeError, match="spec"):
        get_compressor(0.01)


def test_compressed_nbytes_counts_every_tensor():
    compressed = Compressed({"a": torch.zeros(10, dtype=torch.int8), "b": torch.zeros(3)}, {})
    assert compressed.nbytes() == 10 + 12
    assert issubclass(TopKCompressor, Compressor)
