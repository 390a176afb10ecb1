"""trainmesh.initialize on a CPU process keeps freed tensor memory (runtime/host_allocator.py):
a 64 MB tensor allocated again after being freed reuses its pages instead of faulting in fresh
ones, which glibc's defaults do every time (64 MB is above its largest dynamic mmap threshold).
Each case runs in its own interpreter: malloc settings are process-wide."""

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource, sys, torch
import torch.distributed as dist
import trainmesh as tm
from trainmesh.runtime.host_allocator import host_malloc_setting
if sys.argv[1] == "adopt":  # a group the program started itself (as torchrun scripts and our test harness do)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
tm.initialize()
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(64 * 2**20 // 4)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
tm.shutdown()
print(json.dumps({"faults": faults, "setting": host_malloc_setting()}))
"""
PAGES = 64 * 2**20 // 4096


def _probe(setting: str, start: str = "initialize") -> dict:
    env = {**os.environ, "TRAINMESH_HOST_MALLOC": setting, "CUDA_VISIBLE_DEVICES": ""}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", PROBE, start], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.timeout(300)
def test_initialize_reuses_freed_tensor_pages_on_cpu():
    tuned, default, adopted = _probe("tuned"), _probe("default"), _probe("tuned", start="adopt")
    assert tuned["setting"].startswith("glibc mallopt"), tuned
    assert adopted["setting"] == tuned["setting"], adopted
    assert default["setting"] == "glibc defaults", default
    # glibc's defaults: every allocation maps and faults in all of its pages again
    assert min(default["faults"][-10:]) > 0.9 * PAGES, default
    # tuned: after the first allocations warm the heap, the pages are reused. The median of the
    # last ten, not their maximum: one CI run saw eight allocations in a row fault in every page
    # before reuse set in (not reproduced here in 50 runs, under memory churn or not); glibc's
    # defaults fault on every one, which this still tells apart.
    steady = sorted(tuned["faults"][-10:])
    assert steady[len(steady) // 2] < 0.05 * PAGES, tuned


def test_a_wrong_setting_is_named():
    from trainmesh.runtime import host_allocator

    saved = list(host_allocator._applied)
    host_allocator._applied.clear()
    os.environ[host_allocator.ENV_SWITCH] = "jemalloc"
    try:
        with pytest.raises(ValueError, match="TRAINMESH_HOST_MALLOC must be 'tuned'"):
            host_allocator.keep_freed_host_memory()
    finally:
        del os.environ[host_allocator.ENV_SWITCH]
        host_allocator._applied[:] = saved
