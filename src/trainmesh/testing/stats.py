"""Small statistics the benchmarks share (a library module, so the benchmark scripts import it by name)."""

from __future__ import annotations


def ci95(values: list[float]) -> tuple[float, float]:
    """The central 95% range of ``values`` (the whole range when there are fewer than 40)."""
    values = sorted(values)
    k = max(0, int(len(values) * 0.025))
    return values[k], values[-1 - k]


def median_ci95(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (seeded: the same values give the same
    interval): what the benchmarks print beside a median of interleaved rounds."""
    import random
    import statistics

    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return boots[int(resamples * 0.025)], boots[int(resamples * 0.975) - 1]
