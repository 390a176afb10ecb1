"""A script that never calls shutdown() still leaves cleanly: the group trainmesh started is
destroyed at interpreter exit, before finalization (see ``process_group._release_at_exit``).

Without it, a torchrun script ending right after ``fit`` died with SIGABRT about once in six
runs (gloo's worker thread freeing a finished collective's tensors during finalization)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
# atexit runs last-registered first: the report below runs after anything trainmesh registers later.
REPORT = 'atexit.register(lambda: print("group alive at the end:", dist.is_initialized(), flush=True))'


def run(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_group_trainmesh_started_is_destroyed_at_exit():
    out = run(
        textwrap.dedent(f"""
        import atexit, torch.distributed as dist, trainmesh as tm
        {REPORT}
        tm.initialize()
        print("initialized:", dist.is_initialized(), flush=True)
    """)
    )
    assert "initialized: True" in out
    assert "group alive at the end: False" in out


def test_a_group_the_user_started_is_left_to_the_user():
    # trainmesh adopts a group it did not start and must not tear it down behind the user's back.
    out = run(
        textwrap.dedent(f"""
        import atexit, torch.distributed as dist, trainmesh as tm
        {REPORT}
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        tm.initialize()
    """)
    )
    assert "group alive at the end: True" in out
