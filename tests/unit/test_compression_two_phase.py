"""One-process checks of the pieces behind the two-phase exchange, the overlap worker, host
discovery and the wire-byte accounting (the multi-process behaviour: test_compressed_allreduce)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from trainmesh.comm.accounting import ByteCounter
from trainmesh.comm.bucket_worker import BucketMerger, BucketWorker
from trainmesh.comm.ddp_hooks import ring_wire_bytes
from trainmesh.comm.packing import pack, unpack
from trainmesh.comm.topology import HOST_ID_ENV, Topology, interface_address, local_host_id
from trainmesh.comm.two_phase import two_phase_wire_bytes
from trainmesh.compression import Int8Compressor, TopKCompressor

pytestmark = pytest.mark.timeout(60)


def test_two_phase_wire_formula_counts_values_scales_and_alignment():
    # 10_000 elements over 4: rows of 2500 int8 (aligned to 2504) + 2 fp32 scales (8 bytes), sent
    # to 3 peers in each phase.
    assert two_phase_wire_bytes(10_000, 4, 2048) == 2 * 3 * (2504 + 8)
    assert two_phase_wire_bytes(10_000, 1, 2048) == 0
    for world in (2, 4, 8, 16, 128, 1024):
        numel = 2**24
        fp32_ring = ring_wire_bytes(numel * 4, world)
        assert 3.9 < fp32_ring / two_phase_wire_bytes(numel, world, 2048) <= 4.0
        # The all-gather alternative: every rank's whole int8 payload to N-1 peers.
        all_gather = (world - 1) * (numel + 4 * math.ceil(numel / 2048))
        assert (all_gather > fp32_ring) == (world >= 8)  # the issue: "at 8 or more it sends more"


def test_packed_payloads_round_trip_bit_exactly():
    compressor = Int8Compressor()
    payloads = [compressor.compress(torch.randn(3000)), TopKCompressor(0.1).compress(torch.randn(7, 5), key="w")]
    buffer, layout = pack(payloads)
    assert buffer.dtype == torch.uint8 and all(offset % 8 == 0 for *_, offset in layout)
    for sent, got in zip(payloads, unpack(buffer.clone(), layout, payloads)):
        for name, tensor in sent.tensors.items():
            assert torch.equal(got.tensors[name], tensor)


def test_worker_runs_jobs_in_order_on_its_own_thread_and_reports_errors():
    worker = BucketWorker(name="t-worker")
    seen = []

    def job(i):
        def run():
            seen.append((i, threading.current_thread().name))
            if i == 2:
                raise ValueError("boom in job 2")
            return torch.tensor([float(i)])

        return run

    futures = [worker.run(job(i)) for i in range(4)]
    assert float(futures[3].wait()) == 3.0
    assert seen == [(i, "t-worker") for i in range(4)]
    with pytest.raises(Exception, match="boom in job 2"):
        futures[2].wait()


def test_merger_holds_buckets_until_the_size_or_the_last_bucket():
    worker = BucketWorker()
    calls = []

    def reduce(parts):
        calls.append([p.numel() for p in parts])
        return [p * 2 for p in parts]

    merger = BucketMerger(worker, reduce, bucket_bytes=100)
    futures = [
        merger.add(torch.ones(10), 40, last=False),
        merger.add(torch.ones(20), 40, last=False),
        merger.add(torch.ones(30), 40, last=False),  # 120 >= 100: the first three go together
        merger.add(torch.ones(5), 20, last=True),
    ]  # the last bucket flushes whatever is held
    for future, n in zip(futures, (10, 20, 30, 5)):
        assert torch.equal(future.wait(), torch.full((n,), 2.0))
    assert calls == [[10, 20, 30], [5]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketMerger(worker, reduce, bucket_bytes=-1)


def test_hosts_are_grouped_in_order_of_their_lowest_rank():
    topology = Topology.from_ids(["b", "a", "b", "a", "c", "c"])
    assert topology.hosts == ((0, 2), (1, 3), (4, 5)) and topology.uniform
    assert topology.host_of[3] == 1 and topology.describe() == "3 host(s) x 2 process(es)"
    assert not Topology.from_ids(["a", "a", "b"]).uniform


def test_host_identity_is_the_env_override_or_host_name_and_gloo_address(monkeypatch):
    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("no-such-if0") is None
    monkeypatch.setenv(HOST_ID_ENV, "rack3-node7")
    assert local_host_id() == "rack3-node7"
    monkeypatch.delenv(HOST_ID_ENV)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert local_host_id().endswith("/127.0.0.1")


def test_counter_keeps_wire_bytes_next_to_payload_bytes():
    counter = ByteCounter()
    counter.add(sent=1000, dense=4000, wire=1500, dense_wire=6000)
    step = counter.take()
    assert step.wire_ratio == 4.0 and step.ratio == 4.0
    assert step.as_record()["comm_wire_bytes"] == 1500 and step.as_record()["comm_wire_bytes_fp32"] == 6000
    assert "comm_wire_bytes" not in ByteCounter().take().as_record()
    with pytest.raises(ValueError, match="wire=-1"):
        counter.add(sent=0, dense=0, wire=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_agrees_with_isfinite_for_nan_and_both_infinities_anywhere(dtype):
    from trainmesh.comm.ddp_hooks import all_finite

    for bad in (float("nan"), float("inf"), -float("inf"), None):
        for position in (0, 4097, 99_999):
            x = torch.randn(100_000).to(dtype)
            if bad is not None:
                x[position] = bad
            assert all_finite(x) == bool(torch.isfinite(x).all()) == (bad is None), (dtype, bad, position)
    assert all_finite(torch.empty(0, dtype=dtype)) and all_finite(torch.arange(5))
