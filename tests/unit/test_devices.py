"""list_devices on one uninitialized process (no process group is started)."""

from __future__ import annotations

import os

import pytest
import torch

import trainmesh
from trainmesh.runtime import devices as devices_mod
from trainmesh.runtime import list_devices
from trainmesh.runtime import process_group

pytestmark = pytest.mark.timeout(60)

_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TF_CONFIG",
)


@pytest.fixture(autouse=True)
def single_uninitialized_process(monkeypatch):
    for name in list(os.environ):
        if name in _LAUNCHER_VARS or name.startswith(("TRAINMESH_", "SLURM_")):
            monkeypatch.delenv(name)
    # Hermetic even if another test module left a process group behind.
    monkeypatch.setattr(process_group, "is_initialized", lambda: False)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_default_is_one_cpu_device(no_cuda):
    assert list_devices() == ["cpu:0"]
    assert trainmesh.list_devices() == ["cpu:0"]


@pytest.mark.parametrize("kind", ["cpu", "CPU", "Cpu"])
def test_cpu(no_cuda, kind):
    assert list_devices(kind) == ["cpu:0"]


@pytest.mark.parametrize("kind", ["gpu", "GPU", "cuda"])
def test_gpu_without_cuda_is_empty(no_cuda, kind):
    assert list_devices(kind) == []


@pytest.mark.parametrize("kind", ["tpu", "", "cpu:0", "gpus", "mps"])
def test_bad_device_type(kind):
    with pytest.raises(ValueError, match="device_type"):
        list_devices(kind)


def test_gpu_names_when_cuda_is_available(fake_cuda):
    assert list_devices() == ["gpu:0"]
    assert list_devices("gpu") == ["gpu:0"]
    assert list_devices("cuda") == ["gpu:0"]
    assert list_devices("cpu") == ["cpu:0"]


def test_one_entry_per_process_of_the_detected_job(no_cuda, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    # global names, the same on every process (not just this process's device)
    assert list_devices() == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def test_accelerator_type(no_cuda):
    assert devices_mod.accelerator_type() == "cpu"
    assert devices_mod.local_torch_device() == torch.device("cpu")
    assert devices_mod.torch_device_type() == "cpu"
