"""The statistics the benchmarks read their verdicts from (``revtrain.timing``)."""

from __future__ import annotations

import math
import random

import pytest

from revtrain.timing import iqr, median_interval


def _binomial_cdf(k: int, n: int) -> float:
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


@pytest.mark.parametrize("n", [6, 7, 8, 15, 21, 40, 101])
def test_interval_is_the_widest_order_statistics_that_reach_the_confidence(n: int) -> None:
    values = [float(v) for v in random.Random(n).sample(range(1000), n)]
    got = median_interval(values, 0.95)
    xs = sorted(values)
    j = xs.index(got.low) + 1
    assert got.high == xs[n - j], "symmetric in rank"
    assert 1 - 2 * _binomial_cdf(j - 1, n) == pytest.approx(got.coverage)
    assert got.coverage >= 0.95
    # One rank narrower would fall short of 95% (or leave no interval).
    assert 2 * (j + 1) > n + 1 or 1 - 2 * _binomial_cdf(j, n) < 0.95
    assert got.low <= got.median <= got.high


def test_coverage_holds_on_long_tailed_samples() -> None:
    """Distribution-free: the stated coverage holds for a skewed, heavy-tailed distribution
    (timings on a shared machine), counted over many samples."""
    rng = random.Random(0)
    n, trials = 15, 4000
    true_median = math.exp(0.0)  # median of a lognormal(0, 1)
    hits = 0
    for _ in range(trials):
        got = median_interval([rng.lognormvariate(0, 1) for _ in range(n)])
        hits += got.low <= true_median <= got.high
    expected = median_interval(list(range(n))).coverage  # 0.9649 for n = 15
    # Binomial standard error of the hit rate: ~0.003; allow four of them.
    assert abs(hits / trials - expected) < 4 * math.sqrt(expected * (1 - expected) / trials)


def test_too_few_values_give_min_to_max_and_say_how_sure() -> None:
    got = median_interval([3.0, 1.0, 2.0], 0.95)
    assert (got.low, got.median, got.high) == (1.0, 2.0, 3.0)
    assert got.coverage == pytest.approx(0.75)


def test_verdicts() -> None:
    assert median_interval([0.90, 0.92, 0.95, 0.91, 0.93, 0.94, 0.96]).verdict() == "below"
    assert median_interval([1.02, 1.05, 1.03, 1.01, 1.04, 1.06, 1.03]).verdict() == "above"
    assert median_interval([0.98, 1.02, 1.00, 0.99, 1.01, 1.03, 0.97]).verdict() == "tie"


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0, 2.0], 1.0)


def test_iqr() -> None:
    assert iqr([1.0]) == 0.0
    assert iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0)


@pytest.mark.parametrize("n", [1033, 1100, 5000])
def test_many_rounds_keep_exact_counts(n: int) -> None:
    """The binomial counts stay exact integers: 2^n no longer fits a float from n = 1024."""
    got = median_interval([float(i) for i in range(n)])
    assert got.low < got.median < got.high and 0.95 <= got.coverage < 0.96
    j = int(got.low) + 1
    assert 1 - 2 * _binomial_cdf(j - 1, n) == pytest.approx(got.coverage)


def test_block_ratios_divide_block_totals_and_leave_out_a_partial_block() -> None:
    from revtrain.timing import block_ratios

    assert block_ratios([1, 1, 4, 1, 1, 4, 9], [2, 2, 2, 2, 2, 2, 2], 3) == [1.0, 1.0]
    assert block_ratios([1.0, 3.0], [2.0, 2.0], 1) == [0.5, 1.5]
    with pytest.raises(ValueError, match="block must be at least 1"):
        block_ratios([1.0], [1.0], 0)
