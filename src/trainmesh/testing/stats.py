"""Small statistics the benchmarks share (a library module, so the benchmark scripts import it by name)."""

from __future__ import annotations


def ci95(values: list[float]) -> tuple[float, float]:
    """The central 95% range of ``values`` (the whole range when there are fewer than 40)."""
    values = sorted(values)
    k = max(0, int(len(values) * 0.025))
    return values[k], values[-1 - k]
