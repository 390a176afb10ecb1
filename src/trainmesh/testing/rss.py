"""Resident memory of this process, for bounds on what building and loading a model costs.

``PeakRSSGrowth`` measures how far the process's peak resident set rose above its resident set at
entry. It reads the kernel's high-water mark (``VmHWM``), so no short peak is missed, after
resetting it to the current resident set on entry (``/proc/self/clear_refs``, Linux 4.0+). Where
the reset is refused, the mark may hold an earlier, higher peak (a forked child inherits its
parent's): the growth is then over-stated, never under-stated, the safe side for a bound.
Pages of memory-mapped files count once touched.
"""

from __future__ import annotations

import os
import resource

__all__ = ["PeakRSSGrowth", "current_rss_bytes", "peak_rss_bytes"]


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The kernel's high-water mark of this process's resident set (``VmHWM``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class PeakRSSGrowth:
    """How much this process's peak resident memory grew inside the block, in bytes.

    >>> with PeakRSSGrowth() as growth:      # doctest: +SKIP
    ...     model = distribution.distribute_model(meta_model, weights="llama-dir")
    >>> growth.bytes                          # doctest: +SKIP
    """

    def __enter__(self) -> "PeakRSSGrowth":
        _reset_peak()
        self.start = current_rss_bytes()
        self.bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = max(0, peak_rss_bytes() - self.start)
