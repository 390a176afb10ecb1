"""The DDP hook's whole-bucket path for cast compressors (fp16, bf16 without error feedback) gives
the same average, bit for bit, and the same byte counts as compressing gradient by gradient."""

from types import SimpleNamespace

import pytest
import torch

from trainmesh.comm.accounting import ByteCounter, ring_wire_bytes
from trainmesh.comm.ddp_hooks import _summable, _summable_bucket
from trainmesh.compression import get_compressor


def _state(spec: str, world: int, peers: list[torch.Tensor]):
    """A hook state whose all-reduce adds what ``world - 1`` other ranks would send: ``peers`` are
    their buckets, compressed the same way (so the sum is a real sum of different values)."""
    compressor = get_compressor(spec)

    def all_reduce(tensor: torch.Tensor) -> None:
        for peer in peers:
            tensor += compressor.compress(peer / world).tensors["values"].reshape(tensor.shape)

    return SimpleNamespace(
        compressor=compressor,
        world_size=world,
        all_reduce=all_reduce,
        counter=ByteCounter(),
        allreduce_wire=lambda nbytes: ring_wire_bytes(nbytes, world),
    )


@pytest.mark.parametrize("spec", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_bucket_cast_equals_the_per_gradient_path(spec, dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (13,), (3, 4, 2), (1,)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    bucket = (torch.randn(numel, generator=gen) * 300).to(dtype)  # fp16's range and rounding both matter
    bucket[3] = 1e5  # beyond fp16: inf on both paths
    peers = [(torch.randn(numel, generator=gen) * 300).to(dtype) for _ in range(3)]

    old_state, new_state = _state(spec, 4, peers), _state(spec, 4, peers)
    grads = list(bucket.clone().split([torch.Size(s).numel() for s in shapes]))
    grads = [g.view(s) for g, s in zip(grads, shapes)]
    keys = [f"p{i}" for i in range(len(shapes))]
    per_gradient = torch.cat([t.reshape(-1).to(dtype) for t in _summable(old_state, keys, grads)])

    flat = bucket.clone()
    views = [g.view(s) for g, s in zip(flat.split([torch.Size(s).numel() for s in shapes]), shapes)]
    whole = _summable_bucket(new_state, views, flat)

    assert whole.data_ptr() == flat.data_ptr()  # written into the bucket itself
    assert whole.dtype == dtype
    assert torch.equal(
        whole.view(torch.int16 if dtype != torch.float32 else torch.int32),
        per_gradient.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )
    assert new_state.counter.take() == old_state.counter.take()


@pytest.mark.parametrize("error_feedback", [False, True])
def test_the_hook_takes_the_whole_bucket_path_only_without_error_feedback(error_feedback, monkeypatch):
    from trainmesh.comm import ddp_hooks
    from trainmesh.compression import FP16Compressor

    taken = []
    monkeypatch.setattr(ddp_hooks, "_summable_bucket", lambda *args: taken.append(1) or _summable_bucket(*args))
    state = _state("fp16", 2, [torch.ones(6)])
    state.compressor, state.two_phase = FP16Compressor(error_feedback=error_feedback), False
    flat = torch.arange(6, dtype=torch.float32) / 3
    grads = [flat[:2].view(2), flat[2:].view(2, 2)]
    out = ddp_hooks._reduce_parts(state, [(["a", "b"], grads, flat)])
    assert len(out) == 1 and out[0].numel() == 6
    # residuals are kept per parameter name, which a whole-bucket compress would lose
    assert taken == ([] if error_feedback else [1])
    assert sorted(state.compressor.residuals) == (["a", "b"] if error_feedback else [])


def test_only_cast_compressors_are_elementwise():
    assert get_compressor("fp16").elementwise and get_compressor("bf16").elementwise
    assert not any(get_compressor(s).elementwise for s in ("int8", "topk:0.01", "powersgd:2"))
