"""The test harness's handling of ranks that end badly.

A rank that returned its result and then aborted at interpreter exit (as a process does when a C++
thread is torn down with a collective still pending on a stalled peer) has done its part: its
peers keep running to the end. A rank that dies before returning stops its peers.
"""

from __future__ import annotations

import time

import pytest

from trainmesh.testing import run_distributed
from trainmesh.testing.harness import DistributedTestError

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120), pytest.mark.xdist_group("serial")]

LATE_S = 5.0  # how long rank 1 keeps working after rank 0 has aborted; more than the harness's 2 s grace


def _rank0_aborts_after_returning() -> dict:
    import atexit
    import os

    import trainmesh as tm

    started = time.monotonic()
    if tm.rank() == 0:
        atexit.register(os.abort)  # SIGABRT after the result is written
    else:
        time.sleep(LATE_S)
    return {"rank": tm.rank(), "after_s": time.monotonic() - started}


def _rank0_dies_before_returning() -> dict:
    import os

    import trainmesh as tm

    if tm.rank() == 0:
        os.abort()
    time.sleep(60)
    return {"rank": tm.rank()}


def _rank1_raises() -> dict:
    import trainmesh as tm

    if tm.rank() == 1:
        raise ValueError("rank 1's own mistake")
    time.sleep(60)
    return {"rank": tm.rank()}


def test_the_message_ends_with_each_rank_s_last_line_and_names_the_first_to_fail():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank1_raises, world_size=2, timeout=60)
    summary = str(info.value).rsplit("summary:", 1)[1]
    assert "rank 1 (failed first): ValueError: rank 1's own mistake" in summary, summary
    assert "rank 0: exited with code -9 (SIGKILL)" in summary, summary


def test_a_rank_that_aborts_after_returning_does_not_cut_its_peer_short():
    results = run_distributed(_rank0_aborts_after_returning, world_size=2, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert results[1]["after_s"] >= LATE_S


def test_a_rank_that_dies_before_returning_stops_its_peers():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank0_dies_before_returning, world_size=2, timeout=60)
    assert "rank 0: exited with code" in str(info.value) and "left no result" in str(info.value)
    assert "rank 1: exited with code" in str(info.value)  # stopped, not waited for
    # The message ends with one line a rank, the first to fail marked: a log cut to its tail shows the cause
    summary = str(info.value).rsplit("summary:", 1)[1]
    assert "rank 0 (failed first): exited with code -6 (SIGABRT)" in summary, summary
    assert "rank 1: exited with code -9 (SIGKILL)" in summary, summary
    assert time.monotonic() - started < 30


_ABORTING_JOB = """
import os, sys
sys.path.insert(0, {here!r})
from test_harness_exits import _rank0_dies_before_returning
from trainmesh.testing import run_distributed

if __name__ == "__main__":
    try:
        run_distributed(_rank0_dies_before_returning, world_size=2, timeout=60)
    except Exception:
        pass
"""


def test_a_rank_killed_by_a_signal_leaves_its_python_stack_on_stderr(tmp_path):
    """faulthandler in every rank: a SIGABRT (glibc finding its heap corrupted) still says where the rank was.
    In a fresh interpreter, so the ranks' stderr is this subprocess's (pytest's capture holds the forkserver's)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_ABORTING_JOB.format(here=os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert "Fatal Python error: Aborted" in done.stderr, done.stderr[-3000:]
    assert "_rank0_dies_before_returning" in done.stderr, done.stderr[-3000:]
