"""Waiting on real processes: poll a condition until it holds, failing at once when a process exits.

For tests and benchmarks that start processes themselves (``subprocess.Popen``) and wait for what
they write (a step log, a file removed): a process that exits with an error ends the wait with its
exit code instead of letting it run into the timeout.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

__all__ = ["wait_for"]


def wait_for(
    predicate: Callable[[], bool], timeout_s: float, what: str, procs: Iterable = (), *, poll_s: float = 0.05
) -> None:
    """Return once ``predicate()`` is true; raise ``RuntimeError`` naming ``what`` when ``timeout_s``
    passes first, or when one of ``procs`` (objects with ``poll()`` and ``returncode``, as ``Popen``)
    has exited non-zero."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        for proc in procs:
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"a process exited {proc.returncode} while waiting for {what}")
        time.sleep(poll_s)
    raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
