"""The benchmarks' distribution-free statistics (``benchmarks/stats.py``): pure, no ranks."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

# loaded from its file: benchmarks/ on sys.path would shadow top-level names for the whole session
_path = Path(__file__).resolve().parents[2] / "benchmarks" / "stats.py"
_spec = importlib.util.spec_from_file_location("benchmarks_stats", _path)
_stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_stats)
median_ci, quartiles = _stats.median_ci, _stats.quartiles


def _binom_below(n: int, k: int) -> float:
    """P(Binomial(n, 1/2) <= k - 1)."""
    return sum(math.comb(n, i) for i in range(k)) / 2**n


def test_median_ci_needs_six_values_at_95_percent():
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # P(all above the median) = 1/32 > 2.5%
    assert median_ci([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)  # 1/64 <= 2.5%: min and max


def test_median_ci_takes_the_textbook_order_statistics():
    # n = 100: the 40th and 61st smallest values (the usual table, coverage 96.5%)
    assert median_ci([float(i) for i in range(1, 101)]) == (40.0, 61.0)
    for n in (6, 7, 10, 25, 50, 99, 200):
        lo, hi = median_ci(list(range(1, n + 1)))
        k = int(lo)
        assert hi == n + 1 - k  # symmetric
        assert _binom_below(n, k) <= 0.025 < _binom_below(n, k + 1)  # the narrowest that covers


def test_median_ci_covers_the_median_at_least_95_percent_of_the_time():
    rng = random.Random(0)
    hits = 0
    for _ in range(2000):
        xs = [rng.lognormvariate(0.0, 0.3) for _ in range(30)]  # true median: 1
        lo, hi = median_ci(xs)
        hits += lo <= 1.0 <= hi
    assert hits / 2000 >= 0.94  # nominal 95.7% for n = 30; Monte Carlo slack


def test_quartiles():
    assert quartiles([3.0]) == (3.0, 3.0, 3.0)
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
