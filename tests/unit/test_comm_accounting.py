"""Bytes accounting of gradient communication, the payload packing it counts, and the config knobs."""

from __future__ import annotations

import threading

import pytest
import torch

from trainmesh.comm.accounting import ByteCounter, StepBytes, describe_step, format_bytes
from trainmesh.comm.ddp_hooks import _pack, _unpack
from trainmesh.compression import get_compressor
from trainmesh.trainer.communication import GradientCommunication
from trainmesh.trainer.config import TrainerConfig

pytestmark = pytest.mark.timeout(60)


def test_counter_sums_buckets_until_taken_then_resets():
    counter = ByteCounter()
    counter.add(sent=100, dense=400)
    counter.add(sent=50, dense=200)
    step = counter.take()
    assert (step.compressed, step.uncompressed, step.ratio) == (150, 600, 4.0)
    assert counter.take() == StepBytes(0, 0)
    assert (counter.total_sent, counter.total_dense) == (150, 600)


def test_record_keys_and_ratio_when_nothing_was_sent():
    assert StepBytes(0, 0).ratio == 1.0
    assert StepBytes(10, 40).as_record() == {"comm_bytes": 10, "comm_bytes_uncompressed": 40, "comm_ratio": 4.0}


def test_negative_counts_are_rejected_with_the_values():
    with pytest.raises(ValueError, match="sent=-1"):
        ByteCounter().add(sent=-1, dense=0)


def test_counter_is_safe_to_add_from_several_threads():
    counter = ByteCounter()
    threads = [threading.Thread(target=lambda: [counter.add(sent=1, dense=4) for _ in range(1000)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counter.take() == StepBytes(4000, 16000)


def test_human_readable_bytes_for_the_progress_bar():
    assert format_bytes(512) == "512B"
    assert format_bytes(1536) == "1.5KB"
    assert format_bytes(3 * 2**30) == "3.0GB"
    assert describe_step(StepBytes(2**20, 4 * 2**20)) == "1.0MB/4.0MB (4.0x)"
    record = StepBytes(2**20, 4 * 2**20).as_record()
    assert GradientCommunication.progress_text(record) == "1.0MB/4.0MB (4.0x)"
    assert GradientCommunication.progress_text({"loss": 1.0}) is None


@pytest.mark.parametrize("spec", ["int8", "topk:0.01", "powersgd:2", "fp16"])
def test_packed_payload_is_exactly_what_is_counted_and_unpacks_to_the_same_tensors(spec):
    torch.manual_seed(0)
    compressor = get_compressor(spec)
    # (3 * 65536 + 17 entries: top-k's block counts and 2-byte offsets, between 8-byte aligned tensors)
    grads = [torch.randn(64, 33), torch.randn(7), torch.randn(1), torch.randn(3 * 65536 + 17)]
    payloads = [compressor.compress(g, key=str(i)) for i, g in enumerate(grads)]
    buffer, layout = _pack(payloads)
    assert buffer.dtype == torch.uint8
    sent = sum(p.nbytes() for p in payloads)
    assert sent <= buffer.numel() < sent + 8 * sum(len(p.tensors) for p in payloads)  # only alignment padding
    for original, unpacked in zip(payloads, _unpack(buffer.clone(), layout, payloads)):
        assert original.tensors.keys() == unpacked.tensors.keys()
        for name, tensor in original.tensors.items():
            assert torch.equal(unpacked.tensors[name], tensor)
        torch.testing.assert_close(compressor.decompress(unpacked), compressor.decompress(original))


def test_int8_and_topk_payloads_meet_their_byte_targets_on_a_large_gradient():
    grad = torch.randn(1024, 1024)
    dense = grad.numel() * 4
    assert dense / get_compressor("int8").compress(grad).nbytes() >= 3.9
    topk = get_compressor("topk:0.01").compress(grad).nbytes()
    # (16-bit block offset, fp32 value) per kept entry, plus an int32 count per 65536 entries: ~66.6x
    assert 66 <= dense / topk <= 4 / (0.01 * 6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"compression": "zip"}, "compression"),
        ({"compression": "topk:2"}, "compression"),
        ({"compression": 3}, "compression"),
        ({"hierarchical_allreduce": "yes"}, "hierarchical_allreduce"),
        ({"hierarchical_allreduce": 1}, "hierarchical_allreduce"),
    ],
)
def test_bad_communication_options_are_rejected_with_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**kwargs)


def test_good_communication_options_are_kept():
    config = TrainerConfig(compression="powersgd:2", hierarchical_allreduce=None)
    assert config.compression == "powersgd:2" and config.hierarchical_allreduce is None
    assert TrainerConfig(compression=get_compressor("int8"), hierarchical_allreduce=True).hierarchical_allreduce
