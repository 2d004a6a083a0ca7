"""95 % intervals for the numbers ragen reports: a success rate (Wilson), a mean over seeds (Student's t),
and a paired difference of two success rates on the same episodes.

Pure Python, no SciPy: the t quantiles are tabulated (two-sided 95 %, i.e. the 0.975 quantile).
"""

from __future__ import annotations

import math
import statistics

#: z for a two-sided 95 % interval.
Z95 = 1.959963984540054

#: Student's t 0.975 quantile by degrees of freedom 1..30 (beyond 30 the normal's 1.96 is within 2 %).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (``df >= 1``)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else Z95


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion ``successes / n``:

    ``(p̂ + z²/2n ± z·sqrt(p̂(1-p̂)/n + z²/4n²)) / (1 + z²/n)`` (Wilson 1927). ``(0, 1)`` for ``n = 0``.
    Unlike the normal interval it stays inside [0, 1] and is not empty at p̂ = 0 or 1.
    """
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact at the ends (the formula's rounding is not)
    high = 1.0 if successes >= n else min(1.0, centre + half)
    return low, high


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``values`` with its 95 % Student-t interval (``low`` and ``high`` NaN for
    one value: one seed says nothing about the spread between seeds)."""
    if not values:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def paired_difference(a: list[bool], b: list[bool]) -> tuple[float, float, float]:
    """``(diff, low, high)``: ``mean(b) - mean(a)`` over the same episodes, with a 95 % interval from the paired
    per-episode differences ``d_i = b_i - a_i`` (normal approximation, ``diff ± z·sd(d)/√n``): two checkpoints
    evaluated on the same seeds share each seed's difficulty, so their difference is far less noisy than the two
    rates' own intervals suggest."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} and {len(b)}")
    if not a:
        raise ValueError("no paired episodes")
    diffs = [float(y) - float(x) for x, y in zip(a, b)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, mean, mean
    half = Z95 * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, mean - half, mean + half
