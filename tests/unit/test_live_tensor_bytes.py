"""``trainmesh.testing.memory.LiveTensorBytes``, the measured side of every memory comparison: it counts
what operators allocate, releases it when the last reference dies, follows FSDP2-style storage
resizes, and ignores meta tensors and other devices."""

import torch

from trainmesh.testing.memory import LiveTensorBytes


def test_counts_allocations_releases_them_and_keeps_the_peak():
    with LiveTensorBytes("cpu") as memory:
        a = torch.zeros(1000)  # 4,000 bytes
        b = torch.ones(500, dtype=torch.float64)  # 4,000 bytes
        assert memory.live == 8000 and memory.peak == 8000
        del a
        assert memory.live == 4000 and memory.peak == 8000
        memory.reset_peak()
        assert memory.peak == 4000
        c = b * 2  # a result is a new storage
        assert memory.live == 8000 and memory.peak == 8000
        del b, c
    assert memory.live == 0


def test_follows_storage_resizes_and_in_place_resize():
    with LiveTensorBytes("cpu") as memory:
        gathered = torch.zeros(256)  # 1,024 bytes
        gathered.untyped_storage().resize_(0)  # how FSDP2 frees an all-gathered parameter
        assert memory.live == 0 and memory.peak == 1024
        gathered.untyped_storage().resize_(2048)  # and re-allocates it
        assert memory.live == 2048
        grown = torch.zeros(4)
        grown.resize_(100)  # a mutable op on an argument
        assert memory.live == 2048 + 400


def test_meta_tensors_and_other_devices_are_not_counted():
    with LiveTensorBytes("cpu") as memory:
        torch.empty(10**6, device="meta")
        assert memory.live == 0
    with LiveTensorBytes("cuda") as memory:  # a CPU tensor is not on the device asked for
        kept = torch.zeros(1000)
        assert memory.live == 0 and kept.numel() == 1000
