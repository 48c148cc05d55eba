"""Small distribution-free statistics for the benchmarks (standard library only)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median: two order statistics of ``values``.

    The k-th smallest and the k-th largest value, with k the largest index such that
    ``P(Binomial(n, 1/2) < k) <= (1 - level) / 2``; the interval covers the true median with
    probability at least ``level`` whatever the distribution (for independent samples).
    ``None`` when ``n`` is too small for any such k (fewer than 6 values at 95%).
    """
    xs = sorted(values)
    n = len(xs)
    tail = (1 - level) / 2
    below = 0.0  # P(Binomial(n, 1/2) <= k - 1), for k = 1, 2, ...
    k = 0
    while k < n // 2:
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """``(Q1, median, Q3)`` of ``values`` (linear interpolation, the inclusive method)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3
